"""The divergences of the top-K losses (nitrobrew.topk_kl and nitrobrew.logits.topk_kl) beyond forward KL:
normalize="topk" takes every divergence, between the two distributions renormalized over the K ids. The
weights' sweeps against the float64 reference, the limits that equal other divergences, TVD at ties and
against an independent formula, the errors, and torch.compile; the option matrices are in
test_topk_linear.py and tests/logits/test_topk_logits.py (helpers.TOPK_CASES)."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
import test_topk_linear
from helpers import divergence_kwargs

# Each family's loss from (student inputs, ids, log-probabilities): from hidden states, and from the logits
# that the same hidden states give.
FAMILIES = {
    "hidden": lambda xs, ws, ids, lps, **kw: nitrobrew.topk_kl(xs, ws, ids, lps, **kw),
    "logits": lambda xs, ws, ids, lps, **kw: nitrobrew.logits.topk_kl(xs @ ws.T, ids, lps, **kw),
}


def problem(device, dtype=torch.float64, k=9):
    if device == "cuda" and dtype == torch.float64:
        dtype = torch.float32  # float64 hidden states run on the CPU only; the GPU check tolerances follow tolerance()
    xs, ws, ids, lps, labels = test_topk_linear.make_problem(lead=(3, 7), v=300, k=k, masked_rows=True, dtype=dtype)
    return tuple(t.to(device) for t in (xs, ws, ids, lps, labels))


def tolerance(xs):
    return 1e-14 if xs.dtype == torch.float64 else 1e-5


def loss_and_grads(family, xs, ws, ids, lps, **options):
    leaves = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
    loss = FAMILIES[family](*leaves, ids, lps, normalize="topk", **options)
    return (loss.detach(), *torch.autograd.grad(loss.sum(), leaves))


@pytest.mark.parametrize("name", ["skew_forward_kl", "skew_reverse_kl"])
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_skew_kls_over_alpha(name, alpha, reduction, device):
    xs, ws, ids, lps, labels = problem("cpu", torch.float32, k=17)
    test_topk_linear.check(xs, ws, ids, lps, normalize="topk", beta=(name, alpha), reduction=reduction,
                           labels=labels, temperature=0.7, device=device)


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_at_their_ends_are_the_plain_kls(family, device):
    # alpha = 0 runs the plain KL (the ops map it there: bitwise); alpha = 1 compares a distribution with itself.
    xs, ws, ids, lps, labels = problem(device)
    options = dict(labels=labels, reduction="none", temperature=1.3)
    for weighted, plain in ((dict(divergence="skew_forward_kl", alpha=0.0), dict(divergence="forward_kl")),
                            (dict(divergence="skew_reverse_kl", alpha=0.0), dict(divergence="reverse_kl")),
                            (dict(divergence="jsd", beta=0.0), dict(divergence="forward_kl")),
                            (dict(divergence="jsd", beta=1.0), dict(divergence="reverse_kl"))):
        for a, b in zip(loss_and_grads(family, xs, ws, ids, lps, **options, **weighted),
                        loss_and_grads(family, xs, ws, ids, lps, **options, **plain)):
            assert torch.equal(a, b), (weighted, plain)
    for name in ("skew_forward_kl", "skew_reverse_kl"):
        loss, dxs, dws = loss_and_grads(family, xs, ws, ids, lps, **options, divergence=name, alpha=1.0)
        eps = tolerance(xs)
        assert loss.abs().max() < eps and dxs.abs().max() < eps and dws.abs().max() < eps, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_tvd_at_ties_is_zero_with_zero_gradient(dtype, device):
    # The teacher's log-probabilities are the student's logits at the ids: p~ = q~, every entry a tie, whose
    # subgradient is sign(0) = 0 (a tie: equal logits in rows whose normalizers agree, docs/design.md).
    if device == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float32
    xs, ws, ids, _, labels = problem(device, dtype)
    zs = (xs @ ws.T).requires_grad_()
    lps = zs.detach().gather(-1, ids)
    loss = nitrobrew.logits.topk_kl(zs, ids, lps, normalize="topk", divergence="tvd", labels=labels, reduction="sum")
    (dzs,) = torch.autograd.grad(loss, zs)
    assert loss.item() == 0.0 and dzs.abs().max().item() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_tvd_against_one_minus_the_overlap(family, device):
    # 1/2 sum |p - q| = 1 - sum min(p, q) for two distributions: another formula than the engine's.
    xs, ws, ids, lps, _ = problem(device)
    loss = FAMILIES[family](xs, ws, ids, lps, normalize="topk", divergence="tvd", reduction="none", temperature=0.8)
    p = torch.softmax((xs.double() @ ws.double().T / 0.8).gather(-1, ids), -1)
    q = torch.softmax(lps.double(), -1)
    torch.testing.assert_close(loss.double(), 1 - torch.minimum(p, q).sum(-1), rtol=0, atol=tolerance(xs))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("options, error, match", [
    (dict(divergence="jsd"), ValueError, 'normalize="full" takes divergence="forward_kl" only'),
    (dict(normalize="topk", divergence="kl"), ValueError, "divergence must be one of"),
    (dict(normalize="topk", divergence=["jsd"]), ValueError, "divergence must be one of"),
    (dict(normalize="topk", divergence="tvd", beta=0.5), ValueError, "beta is the weight of 'jsd' only"),
    (dict(normalize="topk", divergence="jsd", alpha=0.5), ValueError, "alpha is the weight of 'skew_forward_kl'"),
    (dict(normalize="topk", divergence="forward_kl", alpha=0.5), ValueError, "alpha is the weight"),
    (dict(normalize="topk", divergence="skew_reverse_kl", alpha=1.5), ValueError, r"alpha must be a number in \[0, 1\]"),
    (dict(normalize="topk", divergence="jsd", beta=float("nan")), ValueError, r"beta must be a number in \[0, 1\]"),
])
def test_errors(family, options, error, match):
    xs, ws, ids, lps, _ = problem("cpu")
    with pytest.raises(error, match=match):
        FAMILIES[family](xs, ws, ids, lps, **options)


@pytest.mark.parametrize("name, weight", [("jsd", dict(beta=0.3)), ("skew_reverse_kl", dict(alpha=0.2)), ("tvd", {})])
def test_torch_compile_fullgraph(name, weight, device):
    xs, ws, ids, lps, labels = problem(device, torch.float32)

    def step(a, w, ids, lps, labels):
        return nitrobrew.topk_kl(a, w, ids, lps, normalize="topk", divergence=name, labels=labels, temperature=1.5,
                                 **weight) * 2.0

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        a, w = xs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss = fn(a, w, ids, lps, labels)
        loss.backward()
        results.append((loss.detach(), a.grad, w.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)


def test_divergence_kwargs_name_the_test_cases():
    assert divergence_kwargs(("skew_forward_kl", 0.2)) == {"divergence": "skew_forward_kl", "alpha": 0.2}
    assert divergence_kwargs(0.3) == {"divergence": "jsd", "beta": 0.3}
