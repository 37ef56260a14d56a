"""Randomized cases of the fused-linear losses against the float64 reference (values and gradients):
sizes that divide no tile, every option drawn at random (tests/randomized.py sets the count)."""

import pytest

from helpers import check_against_reference, make_biases, make_problem
from nitrobrew import reference
from randomized import DEVICES, SEEDS, draw, draw_divergence, log_uniform, loss_floor, rounding_floor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", SEEDS)
def test_randomized(seed, device):
    rng, dtype = draw(seed, device)
    n, v, d_s, d_t = rng.randint(1, 90), rng.randint(2, 900), rng.randint(1, 48), rng.randint(1, 48)
    rows_s, rows_t = v + rng.choice([0, 0, 7]), v + rng.choice([0, 3])
    beta = draw_divergence(rng)
    ce_weight = rng.choice([0.0, 0.0, 0.4])
    options = dict(temperature=log_uniform(rng, 0.2, 5.0), reduction=rng.choice(["mean", "sum", "none"]),
                   softcap_s=rng.choice([None, 25.0]), softcap_t=rng.choice([None, 40.0]), ce_weight=ce_weight)
    if rows_s != rows_t or rng.random() < 0.3:
        options["vocab_size"] = v
    masked = rng.random() < 0.5
    xs, xt, ws, wt, labels = make_problem(n=n, v=v, d_s=d_s, d_t=d_t, scale=log_uniform(rng, 0.3, 12.0),
                                          rows_s=rows_s, rows_t=rows_t, dtype=dtype, device=device,
                                          masked=masked, seed=seed)
    if masked or ce_weight:
        options["labels"] = labels
    chunk_V = rng.choice([None, rng.randint(1, 300)]) if device == "cpu" else None
    # lm_head biases and logit multipliers (drawn last: the earlier draws of a seed stay as they were)
    bias_s, bias_t = make_biases(ws, wt, scale=rng.choice([0.5, 3.0]), seed=seed)
    options.update(bias_s=rng.choice([None, bias_s]), bias_t=rng.choice([None, bias_t]),
                   logit_scale_s=rng.choice([1.0, log_uniform(rng, 0.05, 4.0)]),
                   logit_scale_t=rng.choice([1.0, log_uniform(rng, 0.05, 4.0)]))
    print(f"seed {seed}: n={n} v={v} d_s={d_s} d_t={d_t} rows=({rows_s}, {rows_t}) beta={beta} {dtype} {options}")
    logits = tuple(reference.model_logits(x.double(), w[:v].double(), bias=None if b is None else b[:v].double(),
                                          logit_scale=options[f"logit_scale_{side}"])
                   for x, w, b, side in ((xs, ws, options["bias_s"], "s"), (xt, wt, options["bias_t"], "t")))
    spread = (logits[0] - logits[1]).abs().max().item() / options["temperature"]
    size = max(z.abs().max().item() for z in logits) / options["temperature"]
    check_against_reference(xs, xt, ws, wt, beta=beta, chunk_V=chunk_V, rel_floor=rounding_floor(dtype, spread),
                            loss_floor=loss_floor(dtype, size, v, n, options["reduction"]), **options)
