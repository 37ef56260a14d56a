"""nitrobrew.topk_kl on the training path (grad_in_forward; normalize="full"): when it runs, its values and
gradients on both paths against the float64 reference (several chunks of tokens and steps of products,
masks, biases, logit scales, temperatures; float32 and float64 within 2x the same-precision reference's
error, 16-bit inputs within 1.5x the recompute path's), its errors, and its backward's scaling."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
from conftest import CUDA
from test_topk_linear import check, make_problem

CHUNK_OP = "nitrobrew::products"  # the training path's logits (nitrobrew/_forward_grads.py)
FORWARD_OP = "nitrobrew::topk_linear_fwd"  # the recompute path's forward


def ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()} & {CHUNK_OP, FORWARD_OP}


@pytest.mark.parametrize("case,expected", [
    ("training", CHUNK_OP), ("no_grad", FORWARD_OP), ("none", FORWARD_OP), ("topk", FORWARD_OP),
    ("forced_off", FORWARD_OP), ("forced_on", CHUNK_OP), ("bias_only", CHUNK_OP),
])
def test_which_path_runs(device, case, expected):
    # The training path for normalize="full" when autograd records a graph for xs, ws or bias_s and the loss
    # is a scalar, and it is asked for or the device is one where top-K's automatic choice takes it.
    xs, ws, ids, lps, labels = (t.to(device) for t in make_problem(v=700, k=16, masked_rows=True))
    xs.requires_grad_()
    ws.requires_grad_()
    kw = dict(labels=labels, reduction="none" if case == "none" else "mean",
              normalize="topk" if case == "topk" else "full")
    if case == "forced_on":
        kw["grad_in_forward"] = True
    elif case == "forced_off":
        kw["grad_in_forward"] = False
    elif expected == CHUNK_OP and case != "bias_only" and device not in nitrobrew._forward_grads.TOPK_AUTOMATIC_DEVICES:
        expected = FORWARD_OP
    if case == "bias_only":  # a gradient for bias_s alone: asked for, as the CPU's automatic choice takes none
        xs, ws = xs.detach(), ws.detach()
        kw["bias_s"] = torch.zeros(700, device=device, requires_grad=True)
        kw["grad_in_forward"] = True
    context = torch.no_grad if case == "no_grad" else torch.enable_grad
    with context():
        assert ops_run(lambda: nitrobrew.topk_kl(xs, ws, ids, lps, **kw)) == {expected}


@pytest.mark.parametrize("grad_in_forward", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias,logit_scale", [(False, 1.0), (True, 2.5)])
def test_values_and_gradients_on_both_paths(grad_in_forward, reduction, dtype, bias, logit_scale, device):
    # 300 tokens, V = 1001 (divides no vector or tile), masked rows: under a 1 MiB budget the training path
    # runs 3 chunks of G of two 65-token steps of products each (the last ones partial).
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is CPU-only")
    if device == "cpu" and dtype in (torch.bfloat16, torch.float16):
        pytest.skip("16-bit inputs on the CPU: test_16_bit_inputs_against_the_recompute_path")
    xs, ws, ids, lps, labels = make_problem(lead=(300,), v=1001, k=20, masked_rows=True, dtype=dtype)
    bias_s = (torch.randn(1001, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2).to(dtype)
    check(xs, ws, ids, lps, normalize="full", reduction=reduction, labels=labels, temperature=0.8,
          bias_s=bias_s if bias else None, logit_scale_s=logit_scale, device=device,
          rel_floor=1e-12 if dtype == torch.float64 else 1e-6, grad_in_forward=grad_in_forward, grad_chunk_mib=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs_against_the_recompute_path(dtype):
    # On the CPU the gradients of 16-bit inputs are rounded to their dtype at the end, on either path: each
    # path's error against the float64 oracle, the training path's within 1.5x the recompute path's.
    from nitrobrew import reference

    xs, ws, ids, lps, labels = make_problem(lead=(300,), v=1001, k=20, masked_rows=True)
    bias_s = torch.randn(1001, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2
    options = dict(labels=labels, temperature=0.8, logit_scale_s=2.5)

    def run(fn, dtype, **kw):
        a, w, b = (t.to(dtype).requires_grad_() for t in (xs, ws, bias_s))
        loss = fn(a, w, ids, lps.to(dtype if dtype == torch.float64 else torch.float32), bias_s=b, **options, **kw)
        return [loss.double(), *(g.double() for g in torch.autograd.grad(loss, (a, w, b)))]

    oracle = run(reference.topk_linear, torch.float64)
    paths = {path: run(nitrobrew.topk_kl, dtype, grad_in_forward=path, grad_chunk_mib=1) for path in (False, True)}
    for i, name in enumerate(("loss", "dxs", "dws", "dbias_s")):
        errors = {path: ((out[i] - oracle[i]).norm() / oracle[i].norm()).item() for path, out in paths.items()}
        assert errors[True] <= 1.5 * errors[False] + 1e-7, (name, errors)


@pytest.mark.parametrize("temperature,scale", [(0.1, 3.0), (1.0, 30.0), (10.0, 3.0), (2.0, 1e-3)])
def test_extreme_temperatures_and_logit_scales(temperature, scale, device):
    xs, ws, ids, lps, _ = make_problem(v=500, k=20, scale=scale)
    check(xs, ws, ids, lps, normalize="full", temperature=temperature, reduction="sum", device=device,
          grad_in_forward=True)


def test_teacher_entries_of_zero_probability_and_lead_shapes(device):
    # -inf teacher log-probabilities contribute nothing; a [2, 20] batch of tokens reshapes as the
    # recompute path's.
    xs, ws, ids, lps, labels = make_problem(lead=(2, 20), v=600, k=12, masked_rows=True)
    lps[0, 3, 5:] = float("-inf")
    lps[1, 7, :] = float("-inf")
    check(xs, ws, ids, lps, normalize="full", labels=labels, device=device, grad_in_forward=True)


def test_upstream_gradient_scales_the_saved_gradients(device):
    xs, ws, ids, lps, _ = (t.to(device) for t in make_problem(v=400, k=8))
    grads = []
    for upstream in (1.0, -3.5):
        a, w = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss = nitrobrew.topk_kl(a, w, ids, lps, grad_in_forward=True)
        grads.append(torch.autograd.grad(loss, (a, w), torch.tensor(upstream, device=device)))
    for g1, g2 in zip(*grads):
        torch.testing.assert_close(g2, -3.5 * g1, rtol=1e-6, atol=0)


@pytest.mark.parametrize("options,error,match", [
    (dict(normalize="topk", grad_in_forward=True), ValueError, "normalize=\"full\" only"),
    (dict(reduction="none", grad_in_forward=True), ValueError, "scalar loss"),
    (dict(grad_in_forward="yes"), TypeError, "grad_in_forward must be None"),
    (dict(grad_chunk_mib=0), ValueError, "grad_chunk_mib must be a positive int"),
])
def test_bad_options_are_clear_errors(options, error, match):
    xs, ws, ids, lps, _ = make_problem(v=300, k=8)
    with pytest.raises(error, match=match):
        nitrobrew.topk_kl(xs.requires_grad_(), ws, ids, lps, **options)


def test_no_token(device):
    xs, ws, ids, lps, _ = (t.to(device) for t in make_problem(lead=(0,), v=300, k=8))
    a, w = xs.requires_grad_(), ws.requires_grad_()
    loss = nitrobrew.topk_kl(a, w, ids, lps, reduction="sum", grad_in_forward=True)
    dxs, dws = torch.autograd.grad(loss, (a, w))
    assert loss.item() == 0 and dxs.shape == a.shape and not dws.any()


@CUDA
def test_products_op_matches_a_float32_product_on_cuda():
    # nitrobrew::products: cuBLAS's float32-output product of bf16 operands, rows padded to 8 entries.
    x = torch.randn(70, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1003, 96, device="cuda", dtype=torch.bfloat16)
    z = nitrobrew._registration.ops.products(x, w, 1001)
    assert z.dtype == torch.float32 and z.shape == (70, 1001) and z.stride() == (1008, 1)
    torch.testing.assert_close(z, x.float() @ w[:1001].float().T, rtol=1e-5, atol=1e-4)


def test_products_op_rejects_bad_shapes():
    ops = nitrobrew._registration.ops
    x, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(RuntimeError, match=r"vocab_size must be in \[0, 10\]"):
        ops.products(x, w, 11)
    with pytest.raises(RuntimeError, match=r"x must be \[N, D\] and w \[V, D\]"):
        ops.products(x, torch.randn(10, 7), 10)
    with pytest.raises(RuntimeError, match="share one floating dtype"):
        ops.products(x, w.double(), 10)


def test_products_op_opcheck(device):
    x = torch.randn(9, 24, device=device)
    w = torch.randn(37, 24, device=device)
    torch.library.opcheck(nitrobrew._registration.ops.products.default, (x, w, 33))
