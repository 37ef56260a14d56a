"""Randomized cases of the attention KL against the float64 reference (values and gradients): sizes,
head counts (GQA on either side), head dims, masks and options drawn at random; tests/randomized.py
sets the count."""

import pytest
import torch

from helpers import GQA, check_attention, make_attention
from randomized import DEVICES, SEEDS, draw, log_uniform, loss_floor, rounding_floor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_randomized(seed, device):
    rng, dtype = draw(seed, device)  # CUDA: bfloat16 / float16 on the kernels, float32 on the chunked path
    b, n_q, n_k = rng.randint(1, 3), rng.randint(1, 90), rng.randint(1, 90)
    gqa = rng.choice(list(GQA))
    d_s, d_t = rng.randint(1, 136), rng.randint(1, 136)
    q_s, k_s, q_t, k_t, mask = make_attention(b, n_q, n_k, 4, gqa, d_s, d_t, dtype=dtype,
                                              scale=log_uniform(rng, 0.3, 3.0), masked=rng.random() < 0.5,
                                              seed=seed, device=device)
    options = dict(kind=rng.choice(["forward", "reverse"]), causal=rng.random() < 0.5,
                   temperature=log_uniform(rng, 0.3, 3.0), reduction=rng.choice(["mean", "sum", "none"]),
                   attention_mask=mask)
    if rng.random() < 0.3:
        options["query_mask"] = torch.rand(b, n_q, generator=torch.Generator().manual_seed(seed)).to(device) > 0.2
    print(f"seed {seed}: b={b} n_q={n_q} n_k={n_k} gqa={gqa} d=({d_s}, {d_t}) {dtype} "
          f"{ {key: val for key, val in options.items() if not isinstance(val, torch.Tensor)} }")
    t = options["temperature"]
    scores = [torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(4 // k.shape[2], dim=2))
              * q.shape[-1] ** -0.5 / t for q, k in ((q_s, k_s), (q_t, k_t))]
    spread = (scores[0] - scores[1]).abs().max().item()
    size = max(s.abs().max().item() for s in scores)
    # float32 inputs: float32's rounding floor; float64 and 16-bit ones: check_attention's own floors (the
    # kernels accumulate 16-bit inputs in float32, whose one-pass loss floor applies to them too).
    check_attention(q_s, k_s, q_t, k_t, rel_floor=rounding_floor(dtype, spread) if dtype == torch.float32 else None,
                    loss_floor=loss_floor(torch.float64 if dtype == torch.float64 else torch.float32, size, n_k,
                                          b * 4 * n_q, options["reduction"]), **options)
