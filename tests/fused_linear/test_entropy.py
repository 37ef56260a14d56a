"""The student's entropy formed in the fused-linear losses' own pass (return_entropy=True), on both paths:
against the float64 reference, masked rows 0, no gradient, and the loss and gradients unchanged by it."""

import pytest
import torch

import nitrobrew
from nitrobrew import reference
from conftest import CUDA
from helpers import assert_close_to_oracle, make_biases, make_problem

LOSSES = [("forward_kl", {}), ("reverse_kl", {}), ("jsd", {"beta": 0.3})]
PATHS = ["training", "recompute"]


def _run(divergence, path, xs, xt, ws, wt, **kw):
    fn = getattr(nitrobrew, divergence)
    xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    loss, entropy = fn(xs_, xt, ws_, wt, grad_in_forward=path == "training", return_entropy=True, **kw)
    loss.backward()
    return loss, entropy, xs_.grad, ws_.grad


def _entropy_oracle(xs, ws, kw, dtype):
    keep = ("temperature", "labels", "softcap_s", "vocab_size", "bias_s", "logit_scale_s")
    return reference.student_entropy(xs, ws, dtype=dtype, **{k: v for k, v in kw.items() if k in keep})


@pytest.mark.parametrize("divergence,extra", LOSSES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("temperature", [1.0, 0.05, 20.0])
def test_entropy_against_float64(device, divergence, extra, path, temperature):
    # Sizes that divide no tile; a third of the rows masked; logits of std ~3 (x 20 at temperature 0.05).
    xs, xt, ws, wt, labels = make_problem(n=45, v=700, device=device, masked=True)
    kw = dict(labels=labels, temperature=temperature, **extra)
    loss, entropy, dxs, dws = _run(divergence, path, xs, xt, ws, wt, **kw)
    oracle = _entropy_oracle(xs, ws, kw, torch.float64)
    assert entropy.shape == (45,) and entropy.dtype == torch.float32 and not entropy.requires_grad
    assert_close_to_oracle(entropy, oracle, _entropy_oracle(xs, ws, kw, torch.float32), abs_floor=1e-5,
                           what="entropy")
    assert torch.all(entropy[labels == -100] == 0)
    # The loss and gradients are those of the call without the entropy.
    fn = getattr(nitrobrew, divergence)
    xs_, ws_ = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    plain = fn(xs_, xt, ws_, wt, grad_in_forward=path == "training", **kw)
    plain.backward()
    assert torch.equal(loss, plain) and torch.equal(dxs, xs_.grad) and torch.equal(dws, ws_.grad)


@pytest.mark.parametrize("path", PATHS)
def test_entropy_with_model_options(device, path):
    # Bias, logit scale, soft-cap, padded vocabulary and the CE add-on: the entropy is the transformed,
    # temperature-scaled student distribution's over the real vocabulary; a leading shape is kept.
    xs, xt, ws, wt, labels = make_problem(n=30, v=513, rows_s=520, rows_t=530, lead=(5, 6), device=device,
                                          masked=True)
    bias_s, bias_t = make_biases(ws, wt)
    kw = dict(labels=labels, temperature=1.7, softcap_s=9.0, softcap_t=11.0, vocab_size=513, bias_s=bias_s,
              bias_t=bias_t, logit_scale_s=1.3, logit_scale_t=0.8, ce_weight=0.4, beta=0.6)
    _, entropy, _, _ = _run("jsd", path, xs, xt, ws, wt, **kw)
    assert entropy.shape == (5, 6)
    assert_close_to_oracle(entropy, _entropy_oracle(xs, ws, kw, torch.float64),
                           _entropy_oracle(xs, ws, kw, torch.float32), abs_floor=1e-5, what="entropy")


def test_entropy_float64_and_no_grad():
    # float64 inputs (CPU) give a float64 entropy; without autograd (inference) the recompute path forms it.
    xs, xt, ws, wt, labels = make_problem(n=21, v=301, dtype=torch.float64, masked=True)
    with torch.no_grad():
        loss, entropy = nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, reduction="none", return_entropy=True)
    assert loss.dtype == entropy.dtype == torch.float64
    torch.testing.assert_close(entropy, reference.student_entropy(xs, ws, labels=labels), rtol=1e-12, atol=1e-12)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", PATHS)
def test_entropy_16bit_cuda(dtype, path):
    xs, xt, ws, wt, labels = make_problem(n=300, v=5003, d_s=64, d_t=96, dtype=dtype, device="cuda", masked=True)
    kw = dict(labels=labels, temperature=0.7)
    _, entropy, _, _ = _run("forward_kl", path, xs, xt, ws, wt, **kw)
    # The kernels form the products from the 16-bit inputs in float32: the float64 reference from the same
    # inputs, against the error of naive PyTorch's 16-bit logits.
    assert_close_to_oracle(entropy, _entropy_oracle(xs, ws, kw, torch.float64), _entropy_oracle(xs, ws, kw, None),
                           abs_floor=1e-4, what="entropy")


def test_entropy_rejects_a_bad_flag():
    # Over vocabulary shards: tests/distributed (every other case of vocab_parallel_cases.py, the tensor-parallel
    # and FSDP2 layouts; ranks that disagree on the flag raise: vocab_parallel_cases.errors).
    xs, xt, ws, wt, _ = make_problem(n=4, v=50)
    with pytest.raises(TypeError, match="return_entropy"):
        nitrobrew.forward_kl(xs, xt, ws, wt, return_entropy="yes")


@pytest.mark.parametrize("path", PATHS)
def test_entropy_of_a_nan_row_is_nan(device, path):
    # A NaN logit makes the row's loss NaN (docs/design.md §7), and its entropy too, not 0: a row's vocabulary in
    # one tile (V = 300) and in several (V = 3000), the NaN from the hidden state (every logit) or a bias (one).
    for v, chunk_V in ((300, None), (3000, 256)):
        xs, xt, ws, wt, _ = make_problem(n=6, v=v, device=device)
        xs[2, 0] = float("nan")
        bias_s = torch.zeros(v, device=device)
        bias_s[v // 2] = float("nan")
        for kw in (dict(), dict(bias_s=bias_s)):
            loss, entropy = _run("forward_kl", path, xs, xt, ws, wt, reduction="sum", chunk_V=chunk_V, **kw)[:2]
            rows = [2] if not kw else list(range(6))
            assert torch.isnan(loss) and torch.isnan(entropy[rows]).all()
            assert torch.isfinite(entropy[[r for r in range(6) if r not in rows]]).all()
