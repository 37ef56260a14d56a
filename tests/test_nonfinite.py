"""The non-finite rule of every loss family, on every device (docs/design.md, "Non-finite inputs"):
-inf is probability 0; NaN, and +inf in a logit or log-probability, make that row's loss NaN and
its gradient non-finite, never a silent 0; a distribution with no entry above -inf is undefined
(NaN); clean rows are unaffected. nitrobrew.reference defines the rule, and the ops must agree with
it row by row. Also: ids and labels out of range where the Python check cannot run (torch.compile,
CUDA-graph capture) never reach a device-side assertion."""

from __future__ import annotations

import functools

import pytest
import torch

import nitrobrew
from conftest import CUDA
from helpers import divergence_kwargs, divergence_of, reference_options, weight_kwargs
from nitrobrew import _checks, reference

NAN, INF = float("nan"), float("inf")
BAD = 2  # the row each case spoils
ROWS, V, K, D = 6, 300, 8, 16
# Every divergence, as tests name them (helpers.divergence_of).
DIVERGENCES = [0.0, 1.0, 0.4, ("skew_forward_kl", 0.3), ("skew_reverse_kl", 0.3), ("tvd", 0.0)]


def _loss(module, beta):
    """The function of module (nitrobrew or nitrobrew.logits) for a test's divergence."""
    return functools.partial(getattr(module, divergence_of(beta)), **weight_kwargs(beta))


def _generator():
    return torch.Generator().manual_seed(0)


def check_rows(loss, grad, ref_loss, ref_grad, *, undefined: bool, tol: float):
    """Row BAD is NaN (with a non-finite gradient) or, where the rule defines it, equal to the reference
    like every other row; the clean rows' values and gradients equal the reference's."""
    loss, ref_loss = loss.detach().cpu().double(), ref_loss.detach().cpu()
    grad, ref_grad = grad.cpu().double(), ref_grad.cpu()
    clean = [n for n in range(loss.shape[0]) if n != BAD or not undefined]
    if undefined:
        assert ref_loss[BAD].isnan(), "the reference does not call this row undefined"
        assert loss[BAD].isnan(), f"row {BAD}: {loss[BAD].item()} where the rule says NaN"
        assert not grad[BAD].isfinite().all(), f"row {BAD}: a finite gradient for a NaN loss"
    torch.testing.assert_close(loss[clean], ref_loss[clean], rtol=tol, atol=tol)
    torch.testing.assert_close(grad[clean], ref_grad[clean], rtol=tol, atol=tol)


def check_against_reference(ours, theirs, x, device, *, undefined):
    """ours(x as float32 on device) against theirs(x in float64): the loss rows and dLoss/dx (check_rows)."""
    a = x.float().to(device).requires_grad_()
    loss = ours(a)
    (grad,) = torch.autograd.grad(loss, a, torch.ones_like(loss))
    ref_in = x.clone().requires_grad_()
    ref = theirs(ref_in)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, torch.ones_like(ref))
    check_rows(loss, grad, ref, ref_grad, undefined=undefined, tol=_float_tol(device))


def _float_tol(device):
    return 1e-4 if device == "cpu" else 2e-3  # float32 inputs; the CUDA products may round more


# ----------------------------------------------------------------------------- logits -----
def _spoil_logits(case, zs, zt):
    target = zs if case.endswith("zs") else zt
    if case.startswith("nan entry"):
        target[BAD, 3] = NAN
    elif case.startswith("+inf entry"):
        target[BAD, 3] = INF
    elif case.startswith("nan row"):
        target[BAD] = NAN
    elif case.startswith("nan among -inf"):  # a NaN whose neighbours are all -inf (a running max drops it)
        target[BAD, :64] = -INF
        target[BAD, 9] = NAN
    elif case.startswith("all -inf"):
        target[BAD] = -INF
    elif case.startswith("-inf entries"):
        target[BAD, ::3] = -INF
    return not case.startswith("-inf entries")


LOGIT_CASES = [f"{what} {side}" for what in ("nan entry", "+inf entry", "nan row", "nan among -inf", "all -inf",
                                             "-inf entries") for side in ("zs", "zt")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("beta", DIVERGENCES)
@pytest.mark.parametrize("case", LOGIT_CASES)
def test_logits(device, beta, case):
    g = _generator()
    zt = torch.randn(ROWS, V, generator=g, dtype=torch.float64) * 3
    zs = zt + torch.randn(ROWS, V, generator=g, dtype=torch.float64)
    if case.startswith("-inf entries"):  # q = 0 where p > 0 and back: both sides share the -inf entries
        zs[BAD, ::3] = zt[BAD, ::3] = -INF
        undefined = False
    else:
        undefined = _spoil_logits(case, zs, zt)
    check_against_reference(lambda a: _loss(nitrobrew.logits, beta)(a, zt.float().to(device), reduction="none"),
                            lambda a: reference.logits(a, zt, **reference_options(beta), reduction="none"),
                            zs, device, undefined=undefined)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_masked_rows_are_not_read(device):
    # A NaN in a row whose label is ignore_index: loss 0 there, no gradient, a finite mean.
    g = _generator()
    zs, zt = torch.randn(ROWS, V, generator=g), torch.randn(ROWS, V, generator=g)
    zs[BAD] = NAN
    labels = torch.arange(ROWS)
    labels[BAD] = -100
    for beta in DIVERGENCES:
        fn = _loss(nitrobrew.logits, beta)
        a = zs.to(device).requires_grad_()
        loss = fn(a, zt.to(device), labels=labels.to(device))
        loss.backward()
        assert loss.isfinite() and a.grad.isfinite().all() and (a.grad[BAD] == 0).all()


# ------------------------------------------------------------------------------ top-K -----
TOPK_CASES = ["nan entry", "nan row", "+inf entry", "all -inf", "-inf entries", "nan student logit"]


def _topk_problem():
    g = _generator()
    xs = torch.randn(ROWS, D, generator=g, dtype=torch.float64)
    ws = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.75
    zt = xs @ ws.T + torch.randn(ROWS, V, generator=g, dtype=torch.float64)
    lps, ids = torch.log_softmax(zt, -1).topk(K, dim=-1)
    return xs, ws, ids, lps


def _spoil_teacher(case, lps, normalize):
    """The case's change to the teacher's log-probabilities; whether row BAD is then undefined."""
    if case == "nan entry":
        lps[BAD, 3] = NAN
    elif case == "nan row":
        lps[BAD] = NAN
    elif case == "+inf entry":
        lps[BAD, 3] = INF
    elif case == "all -inf":
        lps[BAD] = -INF
        return normalize == "topk"  # "full": every q_k = 0, loss 0
    elif case == "-inf entries":
        lps[BAD, ::3] = -INF
        return False
    return True


# (normalize, a test's divergence): "topk" rows are the logit-level ops' rows, for every divergence.
TOPK_LOSSES = [("full", 0.0), ("topk", 0.0), ("topk", 0.4), ("topk", ("tvd", 0.0))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("normalize, beta", TOPK_LOSSES)
@pytest.mark.parametrize("case", TOPK_CASES)
def test_topk_from_logits(device, normalize, beta, case):
    xs, ws, ids, lps = _topk_problem()
    zs = xs @ ws.T
    undefined = _spoil_teacher(case, lps, normalize)
    if case == "nan student logit":
        zs[BAD, ids[BAD, 0]] = NAN
    check_against_reference(lambda a: nitrobrew.logits.topk_kl(a, ids.to(device), lps.float().to(device), normalize=normalize,
                                    reduction="none", **divergence_kwargs(beta)),
                            lambda a: reference.topk_logits(a, ids, lps, normalize=normalize, reduction="none",
                                                            **reference_options(beta)),
                            zs, device, undefined=undefined)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("normalize, beta", TOPK_LOSSES)
@pytest.mark.parametrize("case", TOPK_CASES)
def test_topk_from_hidden_states(device, normalize, beta, case):
    xs, ws, ids, lps = _topk_problem()
    undefined = _spoil_teacher(case, lps, normalize)
    if case == "nan student logit":
        xs[BAD, 1] = NAN
    check_against_reference(lambda a: nitrobrew.topk_kl(a, ws.float().to(device), ids.to(device), lps.float().to(device),
                             normalize=normalize, reduction="none", **divergence_kwargs(beta)),
                            lambda a: reference.topk_linear(a, ws, ids, lps, normalize=normalize, reduction="none",
                                                            **reference_options(beta)),
                            xs, device, undefined=undefined)


# ----------------------------------------------------------------------- fused-linear -----
def _linear_problem(case):
    """Hidden states and unembeddings (float64) with row BAD of xs or xt spoiled as `case` says."""
    g = _generator()
    xs, xt = torch.randn(ROWS, D, generator=g, dtype=torch.float64), torch.randn(ROWS, D + 8, generator=g,
                                                                                   dtype=torch.float64)
    ws, wt = torch.randn(V, D, generator=g, dtype=torch.float64), torch.randn(V, D + 8, generator=g,
                                                                               dtype=torch.float64)
    {"nan in xs": xs, "nan in xt": xt, "+inf in xs": xs}[case][BAD, 1] = INF if "inf" in case else NAN
    return xs, xt, ws, wt


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("beta", DIVERGENCES)
@pytest.mark.parametrize("case", ["nan in xs", "nan in xt", "+inf in xs"])
def test_fused_linear(device, beta, case):
    xs, xt, ws, wt = _linear_problem(case)
    check_against_reference(lambda a: _loss(nitrobrew, beta)(a, xt.float().to(device), ws.float().to(device),
                                                             wt.float().to(device), reduction="none"),
                            lambda a: reference.fused_linear(a, xt, ws, wt, **reference_options(beta), reduction="none"),
                            xs, device, undefined=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("beta", DIVERGENCES)
@pytest.mark.parametrize("case", ["nan in xs", "nan in xt", "+inf in xs"])
def test_fused_linear_training_path(device, beta, case):
    # The training path's loss is a scalar: the spoiled row makes it NaN and its row of xs.grad
    # non-finite, while the clean rows' gradients equal the reference's, as autograd of the reference
    # gives them.
    xs, xt, ws, wt = _linear_problem(case)
    a = xs.float().to(device).requires_grad_()
    loss = _loss(nitrobrew, beta)(a, xt.float().to(device), ws.float().to(device), wt.float().to(device),
                                  reduction="sum", grad_in_forward=True)
    (grad,) = torch.autograd.grad(loss, a)
    ref_in = xs.clone().requires_grad_()
    (ref_grad,) = torch.autograd.grad(reference.fused_linear(ref_in, xt, ws, wt, **reference_options(beta),
                                                             reduction="sum"), ref_in)
    clean = [n for n in range(ROWS) if n != BAD]
    assert loss.isnan() and not grad[BAD].isfinite().all()
    tol = _float_tol(device)
    torch.testing.assert_close(grad[clean].cpu().double(), ref_grad[clean], rtol=tol, atol=tol)


# ------------------------------------------- ids and labels out of range, checks skipped -----
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_labels_out_of_range_with_cross_entropy_raise(device):
    xs, xt = torch.randn(ROWS, D, device=device), torch.randn(ROWS, D, device=device)
    ws, wt = torch.randn(V, D, device=device), torch.randn(V, D, device=device)
    labels = torch.arange(ROWS, device=device)
    labels[BAD] = V + 5
    with pytest.raises(IndexError, match=rf"labels\[{BAD}\] = {V + 5} is outside \[0, V = {V}\) and is not "
                                         r"ignore_index \(-100\); 1 of the 6 entries is outside it"):
        nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, ce_weight=0.5)
    labels[BAD] = -1  # padding marked -1 rather than ignore_index: the message says what to do
    with pytest.raises(IndexError, match=r"A negative id usually marks padding: give those positions ignore_index "
                                         r"\(-100\)"):
        nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, ce_weight=0.5)
    labels[BAD] = -100  # ignored rows may hold anything
    assert nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, ce_weight=0.5).isfinite()


@pytest.fixture
def no_host_checks(monkeypatch):
    """What torch.compile and CUDA-graph capture see: the Python range checks cannot read the device."""
    monkeypatch.setattr(_checks, "host_checks_possible", lambda t: False)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("api", ["logits", "hidden"])
@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_ids_out_of_range_without_the_host_check(no_host_checks, device, api, normalize):
    # The CPU ops raise; the CUDA kernels make the row NaN (no device-side assertion, no read outside
    # the weights), and the next call in the process runs.
    xs, ws, ids, lps = (t.to(device) for t in _topk_problem())
    xs, ws, lps = xs.float(), ws.float(), lps.float()
    bad = ids.clone()
    bad[BAD, 4] = V + 1000
    bad[BAD + 1, 0] = -7

    def loss_of(teacher_ids):
        a = xs.clone().requires_grad_() if api == "hidden" else (xs @ ws.T).requires_grad_()
        if api == "hidden":
            loss = nitrobrew.topk_kl(a, ws, teacher_ids, lps, normalize=normalize, reduction="none")
        else:
            loss = nitrobrew.logits.topk_kl(a, teacher_ids, lps, normalize=normalize, reduction="none")
        (grad,) = torch.autograd.grad(loss, a, torch.ones_like(loss))
        return loss.detach(), grad

    if device == "cpu":
        with pytest.raises(RuntimeError, match="teacher_ids must be in"):
            loss_of(bad)
        return
    loss, grad = loss_of(bad)
    good_loss, good_grad = loss_of(ids)
    torch.cuda.synchronize()
    spoiled = [BAD, BAD + 1]
    clean = [n for n in range(ROWS) if n not in spoiled]
    assert loss[spoiled].isnan().all() and not grad[spoiled].isfinite().any(dim=1).all()
    torch.testing.assert_close(loss[clean], good_loss[clean])
    torch.testing.assert_close(grad[clean], good_grad[clean])
    assert good_loss.isfinite().all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_labels_out_of_range_without_the_host_check(no_host_checks, device):
    g = _generator()
    xs, xt = torch.randn(ROWS, D, generator=g), torch.randn(ROWS, D, generator=g)
    ws, wt = torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)
    xs, xt, ws, wt = (t.to(device) for t in (xs, xt, ws, wt))
    labels = torch.arange(ROWS, device=device)
    labels[BAD] = V
    a = xs.clone().requires_grad_()
    if device == "cpu":
        with pytest.raises(RuntimeError, match="labels must be in"):
            nitrobrew.forward_kl(a, xt, ws, wt, labels=labels, ce_weight=0.5, reduction="none")
        return
    loss = nitrobrew.forward_kl(a, xt, ws, wt, labels=labels, ce_weight=0.5, reduction="none")
    (grad,) = torch.autograd.grad(loss, a, torch.ones_like(loss))
    labels[BAD] = 0
    good = nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, ce_weight=0.5, reduction="none")
    torch.cuda.synchronize()
    clean = [n for n in range(ROWS) if n != BAD]
    assert loss[BAD].isnan() and grad[BAD].isnan().all()
    torch.testing.assert_close(loss[clean], good[clean])


@CUDA
def test_ids_out_of_range_under_torch_compile():
    # The real thing the monkeypatched tests stand for: a compiled step with a bad id gives a NaN row,
    # and the process's CUDA context stays usable.
    xs, ws, ids, lps = (t.cuda() for t in _topk_problem())
    zs, lps = (xs @ ws.T).float(), lps.float()
    step = torch.compile(lambda z, i, l: nitrobrew.logits.topk_kl(z, i, l, reduction="none"), fullgraph=True)
    bad = ids.clone()
    bad[BAD, 1] = V
    loss = step(zs, bad, lps)
    torch.cuda.synchronize()
    assert loss[BAD].isnan() and loss[[n for n in range(ROWS) if n != BAD]].isfinite().all()
    assert step(zs, ids, lps).isfinite().all()
