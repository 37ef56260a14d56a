"""Randomized cases of the top-K loss from hidden states against the float64 reference (values and
gradients); tests/randomized.py sets the count."""

import pytest

import test_topk_linear
from randomized import DEVICES, SEEDS, draw, log_uniform, loss_floor, rounding_floor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_randomized(seed, device):
    rng, dtype = draw(seed, device)
    lead = rng.choice([(rng.randint(1, 70),), (rng.randint(1, 4), rng.randint(1, 20))])
    v, d = rng.randint(2, 1500), rng.randint(1, 48)
    k = rng.randint(1, min(v, 200))
    masked = rng.random() < 0.5
    xs, ws, ids, lps, labels = test_topk_linear.make_problem(lead, v, d, k, scale=log_uniform(rng, 0.3, 10.0),
                                                             dtype=dtype, seed=seed, masked_rows=masked)
    options = dict(temperature=log_uniform(rng, 0.2, 5.0), reduction=rng.choice(["mean", "sum", "none"]),
                   normalize=rng.choice(["full", "topk"]))
    if masked:
        options["labels"] = labels
    chunk_V = rng.choice([None, rng.randint(1, 400)]) if device == "cpu" else None
    print(f"seed {seed}: lead={lead} v={v} d={d} k={k} {dtype} {options}")
    size = (xs.double() @ ws.double().T).abs().max().item() / options["temperature"] + lps.abs().max().item()
    test_topk_linear.check(xs, ws, ids, lps, device=device, chunk_V=chunk_V, rel_floor=rounding_floor(dtype, size),
                           loss_floor=loss_floor(dtype, size, v, xs[..., 0].numel(), options["reduction"]), **options)
