"""The skew KLs (DistiLLM) and total variation distance through the fused-linear losses, beyond the option
matrix of test_fused_linear_values.py: the skew's alpha over [0, 1] on both paths, alpha = 0 as the plain KLs,
TVD at ties and against an independent formula, and bad weights."""

import pytest
import torch

import nitrobrew
from helpers import check_against_reference, make_problem

SKEWS = ["skew_forward_kl", "skew_reverse_kl"]
PLAIN = {"skew_forward_kl": nitrobrew.forward_kl, "skew_reverse_kl": nitrobrew.reverse_kl}


@pytest.mark.parametrize("name", SKEWS)
@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("reduction,grad_in_forward", [("none", None), ("sum", True), ("mean", False)])
def test_skew_alpha(device, name, alpha, reduction, grad_in_forward):
    # N = 37 and V = 1000 over tiles of 96 divide no tile; some rows masked, the CE add-on on.
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    check_against_reference(xs, xt, ws, wt, beta=(name, alpha), labels=labels, ce_weight=0.2, reduction=reduction,
                            chunk_V=96, grad_in_forward=grad_in_forward, grad_chunk_mib=1)


@pytest.mark.parametrize("name", SKEWS)
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_skew_at_alpha_zero_is_the_plain_kl(device, name, grad_in_forward):
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    results = []
    for fn, weight in ((getattr(nitrobrew, name), {"alpha": 0.0}), (PLAIN[name], {})):
        x = xs.clone().requires_grad_()
        loss = fn(x, xt, ws, wt, labels=labels, temperature=2.0, grad_in_forward=grad_in_forward, **weight)
        loss.backward()
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", SKEWS)
def test_skew_at_alpha_one_is_zero(device, name):
    xs, xt, ws, wt, _ = make_problem(device=device)
    x = xs.clone().requires_grad_()
    loss = getattr(nitrobrew, name)(x, xt, ws, wt, alpha=1.0, reduction="sum")
    loss.backward()
    assert abs(loss.item()) < 1e-5 and x.grad.abs().max().item() < 1e-5


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_tvd_at_ties_has_zero_loss_and_gradient(device, grad_in_forward):
    # The student is the teacher: p = q in every entry, the subgradient sign(0) = 0 everywhere.
    xs, _, ws, _, labels = make_problem(device=device, d_t=24, masked=True)
    x = xs.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    loss = nitrobrew.tvd(x, xs, w, ws, labels=labels, reduction="sum", grad_in_forward=grad_in_forward)
    loss.backward()
    assert loss.item() == 0.0
    assert x.grad.abs().max().item() == 0.0 and w.grad.abs().max().item() == 0.0


def test_tvd_against_an_independent_formula(device):
    # TVD = sum_v max(p_v - q_v, 0) = 1 - sum_v min(p_v, q_v); its gradient by autograd of that form.
    xs, xt, ws, wt, _ = make_problem(device=device, dtype=torch.float64 if device == "cpu" else torch.float32)
    x = xs.clone().requires_grad_()
    loss = nitrobrew.tvd(x, xt, ws, wt, temperature=1.5, reduction="sum")
    (grad,) = torch.autograd.grad(loss, x)
    x64 = xs.detach().double().cpu().requires_grad_()
    p = torch.softmax(x64 @ ws.double().cpu().T / 1.5, -1)
    q = torch.softmax(xt.double().cpu() @ wt.double().cpu().T / 1.5, -1)
    independent = (1.0 - torch.minimum(p, q).sum(-1)).sum()
    (grad64,) = torch.autograd.grad(independent, x64)
    tol = 1e-10 if xs.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss.double().cpu(), independent.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(grad.double().cpu(), grad64, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("name", SKEWS)
@pytest.mark.parametrize("alpha", [-0.1, 1.5, float("nan"), "0.1"])
def test_bad_alpha(name, alpha):
    xs, xt, ws, wt, _ = make_problem(n=3, v=10)
    with pytest.raises(ValueError, match="alpha"):
        getattr(nitrobrew, name)(xs, xt, ws, wt, alpha=alpha)


@pytest.mark.parametrize("call, match", [
    (lambda *t: nitrobrew.tvd(*t, alpha=0.1), "unexpected keyword argument 'alpha'"),
    (lambda *t: nitrobrew.tvd(*t, beta=0.1), "unexpected keyword argument 'beta'"),
    (lambda *t: nitrobrew.skew_forward_kl(*t, beta=0.1), "unexpected keyword argument 'beta'"),
    (lambda *t: nitrobrew.jsd(*t, alpha=0.1), "unexpected keyword argument 'alpha'"),
    (lambda *t: nitrobrew.forward_kl(*t, alpha=0.1), "unexpected keyword argument 'alpha'"),
])
def test_weights_of_other_divergences_are_refused(call, match):
    with pytest.raises(TypeError, match=match):
        call(*make_problem(n=3, v=10)[:4])


def test_signatures_name_each_weight():
    import inspect
    assert inspect.signature(nitrobrew.skew_forward_kl).parameters["alpha"].default == 0.1
    assert "beta" not in inspect.signature(nitrobrew.skew_reverse_kl).parameters
    assert not {"alpha", "beta"} & set(inspect.signature(nitrobrew.tvd).parameters)
    assert inspect.signature(nitrobrew.logits.jsd).parameters["beta"].default == 0.5


@pytest.mark.parametrize("name, weight", [("skew_forward_kl", {"alpha": 0.3}), ("skew_reverse_kl", {"alpha": 0.7}),
                                          ("tvd", {})])
def test_the_module_takes_each_divergence(device, name, weight):
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    module = nitrobrew.DistillationLoss(name, temperature=1.5, **weight)
    expected = getattr(nitrobrew, name)(xs, xt, ws, wt, labels=labels, temperature=1.5, **weight)
    assert module(xs, xt, ws, wt, labels).item() == expected.item()
    assert repr(module).startswith(f"DistillationLoss('{name}', " + "".join(f"{k}={v}, " for k, v in weight.items()))
    with pytest.raises(ValueError, match="alpha"):
        nitrobrew.DistillationLoss(name, alpha=1.5)


@pytest.mark.parametrize("name", SKEWS)
def test_logits_skew_at_alpha_zero_is_the_plain_kl(device, name):
    g = torch.Generator().manual_seed(4)
    zs, zt = (torch.randn(9, 300, generator=g) * 3).to(device), (torch.randn(9, 300, generator=g) * 3).to(device)
    plain = {"skew_forward_kl": nitrobrew.logits.forward_kl, "skew_reverse_kl": nitrobrew.logits.reverse_kl}[name]
    results = []
    for fn, weight in ((getattr(nitrobrew.logits, name), {"alpha": 0.0}), (plain, {})):
        z = zs.clone().requires_grad_()
        loss = fn(z, zt, reduction="none", **weight)
        (grad,) = torch.autograd.grad(loss.sum(), z)
        results.append((loss.detach(), grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_logits_tvd_at_ties(device):
    # Equal logits, with a masked entry on both sides: p = q everywhere, the subgradient sign(0) = 0.
    g = torch.Generator().manual_seed(6)
    zt = (torch.randn(5, 257, generator=g) * 4).to(device)
    zt[:, 7] = float("-inf")
    zs = zt.clone().requires_grad_()
    loss = nitrobrew.logits.tvd(zs, zt, reduction="sum")
    (grad,) = torch.autograd.grad(loss, zs)
    assert loss.item() == 0.0 and grad.abs().max().item() == 0.0
