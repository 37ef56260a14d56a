"""nitrobrew.logits (losses from logits the caller holds) against the float64 reference: values and
gradients for every option, -inf entries, errors, opcheck and torch.compile, on the CPU and (where
there is one) a CUDA device; the oracles run on the CPU."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
from helpers import (NEW_DIVERGENCES, assert_close_to_oracle, divergence_of, op_weight, reference_options, row_weights,
                     tvd_slack, weight_kwargs)
from nitrobrew import reference

# forward KL, reverse KL, JSD(0.5), JSD(0.1), and the divergences named by (name, weight) pairs (helpers.py)
BETAS = [0.0, 1.0, 0.5, 0.1, *NEW_DIVERGENCES]


def loss_fn(zs, zt, *, beta, **options):
    return getattr(nitrobrew.logits, divergence_of(beta))(zs, zt, **weight_kwargs(beta), **options)


def make_logits(lead=(37,), v=1500, *, scale=3.0, dtype=torch.float32, seed=0, masked_rows=False):
    """Correlated student and teacher logits (std ~ scale) and labels, some rows ignored."""
    g = torch.Generator().manual_seed(seed)
    zt = torch.randn(*lead, v, generator=g, dtype=torch.float64) * scale
    zs = zt + torch.randn(*lead, v, generator=g, dtype=torch.float64) * scale * 0.5
    labels = torch.randint(0, v, lead, generator=g)
    if masked_rows:
        labels = torch.where(torch.rand(lead, generator=g) < 0.3, torch.full_like(labels, -100), labels)
    return zs.to(dtype), zt.to(dtype), labels


def values_and_grad(fn, zs, zt, upstream, **options):
    zs_ = zs.detach().clone().requires_grad_()
    loss = fn(zs_, zt, **options)
    (dzs,) = torch.autograd.grad(loss, zs_, upstream.to(loss.dtype).to(loss.device))
    return loss.detach().cpu(), dzs.cpu()


def check(zs, zt, *, beta, k=2.0, rel_floor=1e-6, loss_floor=0.0, device="cpu", **options):
    """nitrobrew on `device` vs the float64 oracle, bounded by k x the error of the reference in
    float32 (the precision nitrobrew accumulates 16-bit and float32 inputs in; float64 for float64).
    zs, zt and labels are CPU tensors (moved to `device` for nitrobrew, keeping their strides)."""
    reduction = options.get("reduction", "mean")
    shape = zs.shape[:-1] if reduction == "none" else ()
    upstream = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    same = torch.float64 if zs.dtype == torch.float64 else torch.float32

    def ref(a, b, **kw):
        return reference.logits(a, b, **reference_options(beta), dtype=None, **kw)

    on_device = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in options.items()}
    loss, dzs = values_and_grad(lambda a, b, **kw: loss_fn(a, b, beta=beta, **kw), to_device(zs, device),
                                to_device(zt, device), upstream, **on_device)
    loss64, dzs64 = values_and_grad(ref, zs.double(), zt.double(), upstream, **options)
    loss32, dzs32 = values_and_grad(ref, zs.to(same), zt.to(same), upstream, **options)
    assert loss.dtype == same
    assert dzs.dtype == zs.dtype and dzs.shape == zs.shape
    assert_close_to_oracle(loss, loss64, loss32, k=k, rel_floor=rel_floor, abs_floor=loss_floor,
                           what=f"loss beta={beta}")
    slack = None
    if divergence_of(beta) == "tvd":
        t = options.get("temperature", 1.0)
        weights = row_weights(upstream, zs.shape[:-1], options.get("labels"), reduction)
        slack = tvd_slack(zs.double() / t, zt.double() / t, weights, zs.dtype) / t
    assert_close_to_oracle(dzs, dzs64, dzs32, k=k, rel_floor=rel_floor, slack=slack, what=f"dzs beta={beta}")


def to_device(t, device):
    """t on `device` with the same strides (a plain .to() would make it contiguous)."""
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.copy_(t)


def test_tvd_slack_admits_rounding_only():
    # The TVD tolerance (helpers.tvd_slack) must not pass a wrong gradient: a sign flipped on an entry that is not
    # within rounding of a tie fails, rows equal on both sides get none for ties (only the centre's rounding, 2 ulps
    # of p), and the oracle itself passes.
    zs, zt, _ = make_logits((6,), 300, dtype=torch.float64)
    zt[0] = zs[0]
    upstream = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    z = zs.clone().requires_grad_()
    loss = reference.logits(z, zt, beta=0.0, divergence="tvd", reduction="none", dtype=None)
    (grad,) = torch.autograd.grad(loss, z, upstream)
    slack = tvd_slack(zs, zt, row_weights(upstream, (6,), None, "none"), torch.float32)
    assert slack[0].max() <= 2 * torch.finfo(torch.float32).eps * upstream[0].abs()
    assert slack.max() < 1e-4 * grad.abs().max()
    assert_close_to_oracle(grad, grad, grad.float(), slack=slack)
    wrong = grad.clone()
    v = grad[1].abs().argmax()
    p = torch.softmax(zs[1], -1)[v]
    wrong[1, v] -= upstream[1] * p * torch.sign(grad[1, v] / upstream[1])  # that entry's sign taken as the other
    with pytest.raises(AssertionError):
        assert_close_to_oracle(wrong, grad, grad.float(), slack=slack, rel_floor=0.0)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none", "batchmean"])
def test_values_and_gradients(beta, reduction, device):
    zs, zt, labels = make_logits(masked_rows=True)
    check(zs, zt, beta=beta, reduction=reduction, labels=labels, device=device)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v", [1030, 1024])  # rows of 16-byte multiples or not (CUDA: vector or scalar loads)
def test_dtypes(beta, dtype, v, device):
    zs, zt, _ = make_logits(lead=(2, 9), v=v, dtype=dtype)
    # 16-bit gradients are rounded once more than the float32 reference's: one rounding step at the
    # largest gradient on top of the 2x rule.
    floor = torch.finfo(dtype).eps if dtype != torch.float64 else 1e-6
    check(zs, zt, beta=beta, reduction="none", rel_floor=floor, device=device)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature,scale", [(0.1, 3.0), (1.0, 100.0), (10.0, 3.0), (2.0, 1e-3)])
def test_temperatures_and_logit_scales(beta, temperature, scale, device):
    zs, zt, _ = make_logits(v=777, scale=scale)
    # With scaled logits of ~300, any float32 computation rounds s - t and the reverse-KL / JSD
    # centre at that magnitude: one ulp of max |s - t| per unit of gradient. The fp32 reference sits
    # on the same floor (its error was 1.9e-6 in one draw, nitrobrew's 5.5e-6: 2.9x by the draw), so
    # the floor is that ulp; a wrong term would still be off by O(gradient).
    spread = ((zs - zt).abs().max().item() / temperature)
    floor = max(1e-6, torch.finfo(torch.float32).eps * spread)
    check(zs, zt, beta=beta, temperature=temperature, reduction="sum", rel_floor=floor, device=device)


@pytest.mark.parametrize("beta", [0.5, 0.1])
def test_jsd_of_nearly_equal_distributions_per_row(beta, device):
    # JSD ~1e-8 per row (logit scale 1e-3, temperature 2): each row within 5% of float64. (With its
    # mixture pass in float32, the CUDA kernel's rows came out at 0-30% of the true value, a bias the
    # summed test above once caught.)
    zs, zt, _ = make_logits(v=777, scale=1e-3)
    loss, _ = values_and_grad(lambda a, b, **kw: loss_fn(a, b, beta=beta, **kw), to_device(zs, device),
                              to_device(zt, device), torch.ones(37, dtype=torch.float64), temperature=2.0,
                              reduction="none")
    ref = reference.logits(zs.double(), zt.double(), beta=beta, temperature=2.0, reduction="none")
    torch.testing.assert_close(loss.double(), ref, rtol=0.05, atol=0.0)


@pytest.mark.parametrize("beta", BETAS)
def test_masked_vocabulary_entries(beta, device):
    # Padded vocabulary: the same entries -inf in both models, a whole vocabulary tile of them too.
    zs, zt, _ = make_logits(v=2500)
    pad = torch.zeros(2500, dtype=torch.bool)
    pad[1024:2048] = True
    pad[::7] = True
    zs, zt = zs.masked_fill(pad, float("-inf")), zt.masked_fill(pad, float("-inf"))
    check(zs, zt, beta=beta, reduction="none", device=device)


@pytest.mark.parametrize("beta", [0.5, *NEW_DIVERGENCES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_masked_vocabulary_entries_16bit(beta, dtype, device):
    # On CUDA, 16-bit logits take the second pass in float32 math, where p = q = 0 entries (the same entries -inf
    # in both models) go through the mixture with d = 0 rather than a branch: their terms must be exactly 0, not
    # NaN (d itself is -inf - -inf there). The CPU's mixture math is float64 with the branch.
    zs, zt, _ = make_logits(lead=(2, 9), v=1030, dtype=dtype)
    pad = torch.zeros(1030, dtype=torch.bool)
    pad[512:700] = True
    pad[::5] = True
    zs, zt = zs.masked_fill(pad, float("-inf")), zt.masked_fill(pad, float("-inf"))
    check(zs, zt, beta=beta, reduction="none", rel_floor=torch.finfo(dtype).eps, device=device)


def test_masked_entries_of_one_model(device):
    # q = 0 where only the teacher is -inf: forward KL finite; p = 0 where only the student is: reverse
    # KL finite. Both finite, gradients finite, against the reference. JSD is finite either way (its
    # mixture has mass wherever one side has).
    zs, zt, _ = make_logits(v=600)
    teacher_only = torch.rand(zt.shape, generator=torch.Generator().manual_seed(3)) < 0.2
    check(zs, zt.masked_fill(teacher_only, float("-inf")), beta=0.0, reduction="none", device=device)
    check(zs.masked_fill(teacher_only, float("-inf")), zt, beta=1.0, reduction="none", device=device)
    check(zs, zt.masked_fill(teacher_only, float("-inf")), beta=0.5, reduction="none", device=device)
    check(zs.masked_fill(teacher_only, float("-inf")), zt, beta=0.5, reduction="none", device=device)
    for beta in NEW_DIVERGENCES:  # the skew KLs' mixtures have mass wherever their KL's first side has; TVD is bounded
        check(zs, zt.masked_fill(teacher_only, float("-inf")), beta=beta, reduction="none", device=device)
        check(zs.masked_fill(teacher_only, float("-inf")), zt, beta=beta, reduction="none", device=device)


def test_infinite_divergence_is_not_nan(device):
    # The teacher puts mass where the student has none: KL(q || p) = +inf, reported as such.
    zs = torch.tensor([[0.0, float("-inf"), 1.0]], device=device)
    zt = torch.tensor([[0.0, 2.0, 1.0]], device=device)
    assert nitrobrew.logits.forward_kl(zs, zt).item() == float("inf")


def test_lead_shape_and_non_contiguous_inputs(device):
    zs, zt, labels = make_logits(lead=(4, 6), v=300, masked_rows=True)
    zs_t = zs.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    zt_t = zt[:, :, :].clone()[:, :, torch.arange(300)]
    out = nitrobrew.logits.jsd(to_device(zs_t, device), to_device(zt_t, device), reduction="none",
                               labels=labels.to(device))
    assert out.shape == (4, 6)
    check(zs_t, zt_t, beta=0.5, reduction="none", labels=labels, device=device)


@pytest.mark.parametrize("beta", BETAS)
def test_strided_columns_and_padded_rows(beta, device):
    # Columns at stride 2 (every other entry of a wider tensor), and rows of a padded buffer whose
    # starts are not 16-byte aligned: the kernels read them in place.
    zs, zt, labels = make_logits(lead=(5,), v=2 * 333, masked_rows=True)
    check(zs[:, ::2], zt[:, 1::2], beta=beta, reduction="none", labels=labels, device=device)
    wide_s, wide_t, _ = make_logits(lead=(5,), v=1031)
    check(wide_s[:, 3:1027], wide_t[:, :1024], beta=beta, reduction="none", device=device)


def test_all_rows_ignored_gives_zero(device):
    zs, zt, labels = make_logits(lead=(5,), v=50)
    zs, zt, labels = zs.to(device), zt.to(device), labels.to(device)
    zs.requires_grad_()
    loss = nitrobrew.logits.forward_kl(zs, zt, labels=torch.full_like(labels, -100))
    loss.backward()
    assert loss.item() == 0.0 and zs.grad.abs().max().item() == 0.0


def test_teacher_gets_no_gradient(device):
    zs, zt, _ = make_logits(lead=(4,), v=20)
    zs, zt = zs.to(device), zt.to(device)
    zt.requires_grad_()
    zs.requires_grad_()
    nitrobrew.logits.reverse_kl(zs, zt).backward()
    assert zt.grad is None and zs.grad is not None


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs, zt[:, :5]), ValueError, "same shape|one shape"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs, zt.double()), TypeError, "one dtype"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs.long(), zt), TypeError, "zs must be float"),
        (lambda zs, zt: nitrobrew.logits.jsd(zs, zt, beta=1.5), ValueError, "beta"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs, zt, temperature=0.0), ValueError, "temperature"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs, zt, reduction="avg"), ValueError, "reduction"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs, zt, labels=torch.zeros(3)), TypeError, "int64"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs, zt, labels=torch.zeros(2, dtype=torch.long)), ValueError,
         "leading shape"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs[:, :0], zt[:, :0]), ValueError, "V >= 1"),
        (lambda zs, zt: nitrobrew.logits.forward_kl(zs, zt, ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (lambda zs, zt: nitrobrew.logits.jsd(zs, zt, ignore_index=True), TypeError, "ignore_index must be an int"),
    ],
)
def test_errors(call, error, match):
    zs, zt, _ = make_logits(lead=(3,), v=10)
    with pytest.raises(error, match=match):
        call(zs, zt)


@pytest.mark.parametrize("beta", BETAS)
def test_opcheck(beta, device):
    zs, zt, labels = make_logits(lead=(6,), v=70, masked_rows=True)
    zs, zt, labels = zs.to(device), zt.to(device), labels.to(device)
    zs.requires_grad_()
    options = (-100, divergence_of(beta), op_weight(beta), 1.5)
    torch.library.opcheck(torch.ops.nitrobrew.logits_fwd.default, (zs, zt, labels) + options)
    _, row_stats = torch.ops.nitrobrew.logits_fwd(zs.detach(), zt, labels, *options)
    torch.library.opcheck(torch.ops.nitrobrew.logits_bwd.default,
                          (torch.randn(6, device=device), zs.detach(), zt, labels, row_stats) + options)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_with_backward(dynamic, device):
    zs, zt, labels = make_logits(lead=(8,), v=90, masked_rows=True)
    zs, zt, labels = zs.to(device), zt.to(device), labels.to(device)

    def step(a, b, labels):
        return nitrobrew.logits.jsd(a, b, beta=0.3, temperature=2.0, labels=labels) * 2.0

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (step, compiled):
        a = zs.clone().requires_grad_()
        loss = fn(a, zt, labels)
        loss.backward()
        results.append((loss.detach(), a.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager)
