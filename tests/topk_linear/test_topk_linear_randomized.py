"""Randomized cases of the top-K loss from hidden states against the float64 reference (values and
gradients); tests/randomized.py sets the count."""

import pytest
import torch

import test_topk_linear
from nitrobrew import reference
from randomized import DEVICES, SEEDS, draw, draw_divergence, log_uniform, loss_floor, rounding_floor


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
    # an lm_head bias and a logit multiplier (drawn last: the earlier draws of a seed stay as they were)
    bias = torch.randn(v, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * rng.choice([0.5, 3.0])
    options.update(bias_s=rng.choice([None, bias.to(dtype)]), logit_scale_s=rng.choice([1.0, log_uniform(rng, 0.05, 4.0)]))
    options["beta"] = draw_divergence(rng) if options["normalize"] == "topk" else 0.0
    print(f"seed {seed}: lead={lead} v={v} d={d} k={k} {dtype} {options}")
    logits = reference.model_logits(xs.double(), ws.double(), logit_scale=options["logit_scale_s"],
                                    bias=None if options["bias_s"] is None else options["bias_s"].double())
    size = logits.abs().max().item() / options["temperature"] + lps.abs().max().item()
    test_topk_linear.check(xs, ws, ids, lps, device=device, chunk_V=chunk_V, rel_floor=rounding_floor(dtype, size),
                           loss_floor=loss_floor(dtype, size, v, xs[..., 0].numel(), options["reduction"]), **options)
