"""What the randomized tests share: how many cases, and a seeded draw per case.

NITROBREW_RANDOM_CASES (default 8 per family and device: seconds on the CPU in CI) sets the count; the
GPU runner asks for more. Each case's seed is its test id, so a failing one reruns alone, e.g.
    python -m pytest tests/fused_linear -k "randomized and seed_17"
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from conftest import CUDA

SEEDS = [pytest.param(seed, id=f"seed_{seed}") for seed in range(int(os.environ.get("NITROBREW_RANDOM_CASES", "8")))]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def draw(seed: int, device: str) -> tuple[random.Random, torch.dtype]:
    """The case's generator, and an input dtype the device's kernels take (float32 and float64 on the
    CPU; bfloat16, float16 and float32 on CUDA)."""
    rng = random.Random(seed)
    dtypes = [torch.float32, torch.float64] if device == "cpu" else [torch.bfloat16, torch.float16, torch.float32]
    return rng, rng.choice(dtypes)


def draw_divergence(rng: random.Random):
    """A divergence as tests name it (helpers.divergence_of): every one, JSD's beta or the skew KLs' alpha drawn."""
    weight = round(rng.uniform(0.05, 0.95), 3)
    return rng.choice([0.0, 1.0, weight, ("skew_forward_kl", weight), ("skew_reverse_kl", weight), ("tvd", 0.0)])


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return low * (high / low) ** rng.random()


def rounding_floor(dtype: torch.dtype, spread: float) -> float:
    """The relative floor of a float32 comparison whose scaled logits differ by up to `spread`: any
    float32 computation rounds s - t (and the reverse-KL / JSD centre) at that magnitude, one ulp of it
    per unit of gradient, so the float32 reference sits on the same floor as the kernels
    (tests/logits/test_logits.py::test_temperatures_and_logit_scales)."""
    return 1e-6 if dtype == torch.float64 else max(1e-6, torch.finfo(torch.float32).eps * spread)


def loss_floor(dtype: torch.dtype, spread: float, vocab: int, rows: int, reduction: str) -> float:
    """The absolute rounding floor of a one-pass loss in float32 (float64 for float64 inputs): each row's value
    is a difference of terms of the size of its log-normalizers, |s| + log V, so a row whose divergence is tiny
    (0 at K = 1 over renormalized top-K ids) keeps an error of ~eps of them that a direct sum of p log(p/q)
    does not have ("sum" adds the rows')."""
    import math
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    per_row = 4 * eps * (spread + math.log(max(vocab, 2)))
    return per_row * (rows if reduction == "sum" else 1)
