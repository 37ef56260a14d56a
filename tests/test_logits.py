"""nitrobrew.logits (losses from logits the caller holds) against the float64 reference: values and
gradients for every option, -inf entries, errors, opcheck and torch.compile. CPU kernels."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
from helpers import assert_close_to_oracle
from nitrobrew import reference

BETAS = [0.0, 1.0, 0.5, 0.1]
FUNCTIONS = {0.0: nitrobrew.logits.forward_kl, 1.0: nitrobrew.logits.reverse_kl}


def loss_fn(zs, zt, *, beta, **options):
    if beta in FUNCTIONS:
        return FUNCTIONS[beta](zs, zt, **options)
    return nitrobrew.logits.jsd(zs, zt, beta=beta, **options)


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
    (dzs,) = torch.autograd.grad(loss, zs_, upstream.to(loss.dtype))
    return loss.detach(), dzs


def check(zs, zt, *, beta, k=2.0, rel_floor=1e-6, **options):
    """nitrobrew vs the float64 oracle, bounded by k x the error of the reference in float32 (the
    precision nitrobrew accumulates 16-bit and float32 inputs in; float64 for float64)."""
    reduction = options.get("reduction", "mean")
    shape = zs.shape[:-1] if reduction == "none" else ()
    upstream = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    same = torch.float64 if zs.dtype == torch.float64 else torch.float32

    def ref(a, b, **kw):
        return reference.logit_distill(a, b, beta=beta, dtype=None, **kw)

    loss, dzs = values_and_grad(lambda a, b, **kw: loss_fn(a, b, beta=beta, **kw), zs, zt, upstream, **options)
    loss64, dzs64 = values_and_grad(ref, zs.double(), zt.double(), upstream, **options)
    loss32, dzs32 = values_and_grad(ref, zs.to(same), zt.to(same), upstream, **options)
    assert loss.dtype == same
    assert dzs.dtype == zs.dtype and dzs.shape == zs.shape
    assert_close_to_oracle(loss, loss64, loss32, k=k, rel_floor=rel_floor, what=f"loss beta={beta}")
    assert_close_to_oracle(dzs, dzs64, dzs32, k=k, rel_floor=rel_floor, what=f"dzs beta={beta}")


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none", "batchmean"])
def test_values_and_gradients(beta, reduction):
    zs, zt, labels = make_logits(masked_rows=True)
    check(zs, zt, beta=beta, reduction=reduction, labels=labels)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(beta, dtype):
    zs, zt, _ = make_logits(lead=(2, 9), v=1030, dtype=dtype)
    # 16-bit gradients are rounded once more than the float32 reference's: one rounding step at the
    # largest gradient on top of the 2x rule.
    floor = torch.finfo(dtype).eps if dtype != torch.float64 else 1e-6
    check(zs, zt, beta=beta, reduction="none", rel_floor=floor)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature,scale", [(0.1, 3.0), (1.0, 100.0), (10.0, 3.0), (2.0, 1e-3)])
def test_temperatures_and_logit_scales(beta, temperature, scale):
    zs, zt, _ = make_logits(v=777, scale=scale)
    # With scaled logits of ~300, any float32 computation rounds s - t and the reverse-KL / JSD
    # centre at that magnitude: one ulp of max |s - t| per unit of gradient. The fp32 reference sits
    # on the same floor (its error was 1.9e-6 in one draw, nitrobrew's 5.5e-6: 2.9x by the draw), so
    # the floor is that ulp; a wrong term would still be off by O(gradient).
    spread = ((zs - zt).abs().max().item() / temperature)
    floor = max(1e-6, torch.finfo(torch.float32).eps * spread)
    check(zs, zt, beta=beta, temperature=temperature, reduction="sum", rel_floor=floor)


@pytest.mark.parametrize("beta", BETAS)
def test_masked_vocabulary_entries(beta):
    # Padded vocabulary: the same entries -inf in both models, a whole vocabulary tile of them too.
    zs, zt, _ = make_logits(v=2500)
    pad = torch.zeros(2500, dtype=torch.bool)
    pad[1024:2048] = True
    pad[::7] = True
    zs, zt = zs.masked_fill(pad, float("-inf")), zt.masked_fill(pad, float("-inf"))
    check(zs, zt, beta=beta, reduction="none")


def test_masked_entries_of_one_model():
    # q = 0 where only the teacher is -inf: forward KL finite; p = 0 where only the student is: reverse
    # KL finite. Both finite, gradients finite, against the reference.
    zs, zt, _ = make_logits(v=600)
    teacher_only = torch.rand(zt.shape, generator=torch.Generator().manual_seed(3)) < 0.2
    check(zs, zt.masked_fill(teacher_only, float("-inf")), beta=0.0, reduction="none")
    check(zs.masked_fill(teacher_only, float("-inf")), zt, beta=1.0, reduction="none")


def test_infinite_divergence_is_not_nan():
    # The teacher puts mass where the student has none: KL(q || p) = +inf, reported as such.
    zs = torch.tensor([[0.0, float("-inf"), 1.0]])
    zt = torch.tensor([[0.0, 2.0, 1.0]])
    assert nitrobrew.logits.forward_kl(zs, zt).item() == float("inf")


def test_rows_without_finite_logits_are_an_error():
    zs, zt, _ = make_logits(lead=(3,), v=10)
    zt[1] = float("-inf")
    with pytest.raises(RuntimeError, match="row 1 has no finite logit"):
        nitrobrew.logits.forward_kl(zs, zt)


def test_lead_shape_and_non_contiguous_inputs():
    zs, zt, labels = make_logits(lead=(4, 6), v=300, masked_rows=True)
    zs_t = zs.transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    zt_t = zt[:, :, :].clone()[:, :, torch.arange(300)]
    out = nitrobrew.logits.jsd(zs_t, zt_t, reduction="none", labels=labels)
    assert out.shape == (4, 6)
    check(zs_t, zt_t, beta=0.5, reduction="none", labels=labels)


def test_all_rows_ignored_gives_zero():
    zs, zt, labels = make_logits(lead=(5,), v=50)
    zs.requires_grad_()
    loss = nitrobrew.logits.forward_kl(zs, zt, labels=torch.full_like(labels, -100))
    loss.backward()
    assert loss.item() == 0.0 and zs.grad.abs().max().item() == 0.0


def test_teacher_gets_no_gradient():
    zs, zt, _ = make_logits(lead=(4,), v=20)
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
    ],
)
def test_errors(call, error, match):
    zs, zt, _ = make_logits(lead=(3,), v=10)
    with pytest.raises(error, match=match):
        call(zs, zt)


@pytest.mark.parametrize("beta", BETAS)
def test_opcheck(beta):
    zs, zt, labels = make_logits(lead=(6,), v=70, masked_rows=True)
    zs.requires_grad_()
    torch.library.opcheck(torch.ops.nitrobrew.logit_distill_fwd.default, (zs, zt, labels, -100, beta, 1.5))
    _, row_stats = torch.ops.nitrobrew.logit_distill_fwd(zs.detach(), zt, labels, -100, beta, 1.5)
    torch.library.opcheck(torch.ops.nitrobrew.logit_distill_bwd.default,
                          (torch.randn(6), zs.detach(), zt, labels, row_stats, -100, beta, 1.5))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_with_backward(dynamic):
    zs, zt, labels = make_logits(lead=(8,), v=90, masked_rows=True)

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
