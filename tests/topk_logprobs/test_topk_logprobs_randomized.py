"""Randomized cases of nitrobrew.topk_logprobs against the float64 reference; tests/randomized.py sets the
count. The CPU draws also run the chunked path (CUDA's for now) on their 32-bit cases; the CUDA draws of a
development build also the walk path, forced."""

import os

import pytest
import torch

import test_topk_logprobs
from randomized import DEVICES, SEEDS, draw, log_uniform


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_randomized(seed, device):
    rng, dtype = draw(seed, device)
    n, v, d = rng.randint(1, 90), rng.randint(1, 3000), rng.randint(1, 64)
    k = rng.randint(1, min(v, 1024))
    x, w = test_topk_logprobs.problem(n, v, d, dtype=dtype, device=device, scale=log_uniform(rng, 0.1, 20.0), seed=seed)
    options = dict(temperature=log_uniform(rng, 0.05, 10.0))
    if rng.random() < 0.5:
        options["bias"] = (torch.randn(v, generator=torch.Generator().manual_seed(seed)) * rng.choice([0.5, 4.0])).to(
            device, dtype)
    if rng.random() < 0.3:
        options["logit_scale"] = log_uniform(rng, 0.05, 4.0)
    if rng.random() < 0.3:
        options["softcap"] = log_uniform(rng, 1.0, 50.0)
    if rng.random() < 0.3 and v > k:
        options["vocab_size"] = rng.randint(k, v)
    if rng.random() < 0.2:  # ties: rows of w repeated, so whole columns of logits are equal
        w[1::2] = w[0:-1:2] if v % 2 == 1 else w[0::2]
    print(f"seed {seed}: n={n} v={v} d={d} k={k} {dtype} {options}")
    test_topk_logprobs.check(x, w, k, **options)
    if device == "cuda" and os.environ.get("NITROBREW_DEV_KNOBS") == "1":  # the walk forced, lists full or not
        setting = rng.choice([test_topk_logprobs.WALK, test_topk_logprobs.WALK_OVERFLOWING, "256:1024"])
        with test_topk_logprobs.walk(setting):
            test_topk_logprobs.check(x, w, k, **options)
    if device == "cpu" and dtype == torch.float32:
        test_topk_logprobs.check(x, w, k, implementation=test_topk_logprobs.chunked, **options)
