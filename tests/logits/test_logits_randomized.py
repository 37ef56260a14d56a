"""Randomized cases of the losses from logits (both top-K normalizations included) against the
float64 reference (values and gradients); tests/randomized.py sets the count."""

import pytest

import test_logits
import test_topk_logits
from randomized import DEVICES, SEEDS, draw, draw_divergence, log_uniform, loss_floor, rounding_floor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_randomized(seed, device):
    rng, dtype = draw(seed, device)
    lead = rng.choice([(rng.randint(1, 60),), (rng.randint(1, 4), rng.randint(1, 20))])
    v = rng.randint(2, 2500)
    options = dict(temperature=log_uniform(rng, 0.2, 5.0), reduction=rng.choice(["mean", "sum", "none"]))
    masked = rng.random() < 0.5
    zs, zt, labels = test_logits.make_logits(lead, v, scale=log_uniform(rng, 0.3, 12.0), dtype=dtype, seed=seed,
                                             masked_rows=masked)
    if masked:
        options["labels"] = labels
    beta = draw_divergence(rng)
    print(f"seed {seed}: lead={lead} v={v} beta={beta} {dtype} {options}")
    t, rows = options["temperature"], zs[..., 0].numel()
    spread = (zs.double() - zt.double()).abs().max().item() / t
    size = max(zs.double().abs().max().item(), zt.double().abs().max().item()) / t
    test_logits.check(zs, zt, beta=beta, device=device, rel_floor=rounding_floor(dtype, spread),
                      loss_floor=loss_floor(dtype, size, v, rows, options["reduction"]), **options)
    k = rng.randint(1, min(v, 300))
    zs, ids, lps, labels = test_topk_logits.make_topk(lead, v, k, scale=log_uniform(rng, 0.3, 12.0), dtype=dtype,
                                                      seed=seed, masked_rows=masked)
    if masked:
        options["labels"] = labels
    options["normalize"] = rng.choice(["full", "topk"])
    options["beta"] = draw_divergence(rng) if options["normalize"] == "topk" else 0.0
    print(f"seed {seed}: top-K k={k} {options}")
    size = zs.double().abs().max().item() / t + lps.abs().max().item()
    test_topk_logits.check(zs, ids, lps, device=device, rel_floor=rounding_floor(dtype, size),
                           loss_floor=loss_floor(dtype, size, v, rows, options["reduction"]), **options)
