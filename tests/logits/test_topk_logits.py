"""nitrobrew.logits.topk_kl (distillation against a teacher's top-K log-probabilities) against the
float64 reference: values and gradients for both normalizations and every option, errors, opcheck and
torch.compile, on the CPU and (where there is one) a CUDA device; the oracles run on the CPU."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
from conftest import CUDA
from helpers import (TOPK_CASES, assert_close_to_oracle, divergence_kwargs, divergence_of, reference_options, row_weights,
                     topk_tvd_slack)
from nitrobrew import reference

NORMALIZE = ["full", "topk"]


def make_topk(lead=(29,), v=1300, k=32, *, scale=3.0, dtype=torch.float32, seed=0, masked_rows=False,
              shuffle=True):
    """Student logits, and the top-K ids and log-probabilities of a correlated teacher (any order)."""
    g = torch.Generator().manual_seed(seed)
    zt = torch.randn(*lead, v, generator=g, dtype=torch.float64) * scale
    zs = zt + torch.randn(*lead, v, generator=g, dtype=torch.float64) * scale * 0.5
    logprobs, ids = torch.log_softmax(zt, -1).topk(k, dim=-1)
    if shuffle:
        order = torch.argsort(torch.rand(*lead, k, generator=g), dim=-1)
        logprobs, ids = logprobs.gather(-1, order), ids.gather(-1, order)
    labels = torch.randint(0, v, lead, generator=g)
    if masked_rows:
        labels = torch.where(torch.rand(lead, generator=g) < 0.3, torch.full_like(labels, -100), labels)
    return zs.to(dtype), ids, logprobs.float(), labels


def to_device(t, device):
    """t on `device` with the same strides (a plain .to() would make it contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)


def values_and_grad(fn, zs, ids, lps, upstream, **options):
    zs_ = zs.detach().clone().requires_grad_()
    loss = fn(zs_, ids, lps, **options)
    (dzs,) = torch.autograd.grad(loss, zs_, upstream.to(loss.dtype).to(loss.device))
    return loss.detach().cpu(), dzs.cpu()


def check(zs, ids, lps, *, k=2.0, rel_floor=1e-6, loss_floor=0.0, device="cpu", beta=0.0, **options):
    """nitrobrew on `device` vs the float64 oracle, within k x the error of the reference in the
    precision nitrobrew accumulates in (float32, float64 for float64 inputs). Inputs are CPU tensors.
    beta: the divergence, as helpers.divergence_of names it."""
    reduction = options.get("reduction", "mean")
    shape = zs.shape[:-1] if reduction == "none" else ()
    upstream = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    same = torch.float64 if zs.dtype == torch.float64 else torch.float32

    def ref(a, i, lp, **kw):
        return reference.topk_logits(a, i, lp.to(a.dtype), dtype=None, **reference_options(beta), **kw)

    on_device = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in options.items()}
    loss, dzs = values_and_grad(nitrobrew.logits.topk_kl, to_device(zs, device), ids.to(device), lps.to(device),
                                upstream, **on_device, **divergence_kwargs(beta))
    loss64, dzs64 = values_and_grad(ref, zs.double(), ids, lps.double(), upstream, **options)
    loss32, dzs32 = values_and_grad(ref, zs.to(same), ids, lps.to(same), upstream, **options)
    assert loss.dtype == same and dzs.dtype == zs.dtype
    what = f"normalize={options.get('normalize', 'full')} {divergence_kwargs(beta)}"
    assert_close_to_oracle(loss, loss64, loss32, k=k, rel_floor=rel_floor, abs_floor=loss_floor, what=f"loss {what}")
    slack = None
    if divergence_of(beta) == "tvd":
        weights = row_weights(upstream, zs.shape[:-1], options.get("labels"), reduction)
        slack = topk_tvd_slack(zs, ids, lps.double(), weights, zs.dtype, options.get("temperature", 1.0))
    assert_close_to_oracle(dzs, dzs64, dzs32, k=k, rel_floor=rel_floor, slack=slack, what=f"dzs {what}")


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("k", [1, 7, 128])
def test_values_and_gradients(normalize, beta, reduction, k, device):
    zs, ids, lps, labels = make_topk(k=k, masked_rows=True)
    check(zs, ids, lps, normalize=normalize, beta=beta, reduction=reduction, labels=labels, device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_dtypes(normalize, beta, dtype, device):
    zs, ids, lps, _ = make_topk(lead=(3, 5), v=700, k=16, dtype=dtype)
    floor = torch.finfo(dtype).eps if dtype != torch.float64 else 1e-6  # one output rounding step
    check(zs, ids, lps, normalize=normalize, beta=beta, reduction="none", rel_floor=floor, device=device)


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("lp_dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_teacher_logprob_dtypes(normalize, lp_dtype, device):
    # The CUDA kernels read float32 and float64 log-probabilities as given and widen 16-bit ones first.
    zs, ids, lps, labels = make_topk(k=24, masked_rows=True)
    check(zs, ids, lps.to(lp_dtype), normalize=normalize, reduction="none", labels=labels, device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("temperature,scale", [(0.1, 3.0), (1.0, 30.0), (10.0, 3.0), (2.0, 1e-3)])
def test_temperatures_and_logit_scales(normalize, beta, temperature, scale, device):
    zs, ids, lps, _ = make_topk(v=500, k=20, scale=scale)
    check(zs, ids, lps, normalize=normalize, beta=beta, temperature=temperature, reduction="sum", device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("k", [12, 300, 4100])  # 4100: above the CUDA backward's limit for sorting ids
def test_repeated_ids(normalize, beta, k, device):
    # An id listed twice counts twice (as in the reference's gather); the CUDA backward writes each
    # id's entry once, with all its occurrences.
    zs, ids, lps, _ = make_topk(v=max(300, k + 200), k=k)
    ids[:, 5] = ids[:, 2]
    ids[3, 7:] = ids[3, 0]
    check(zs, ids, lps, normalize=normalize, beta=beta, reduction="none", device=device)


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_vocabulary_too_large_for_the_id_bitmap(normalize, device):
    # Above 2^19 entries the CUDA kernels keep no bitmap of the ids and visit them after their pass over
    # the row (sorted ids, repeats included).
    zs, ids, lps, _ = make_topk(lead=(3,), v=530_000, k=40)
    ids[:, 5] = ids[:, 2]
    check(zs, ids, lps, normalize=normalize, reduction="none", device=device)


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_ids_sharing_their_low_bits(normalize, device):
    # Every id a multiple of 1024 (and some repeated): the CUDA backward hashes ids into a table, and
    # hashes built from an id's low bits would send all of these to one entry.
    zs, _, lps, _ = make_topk(lead=(6,), v=70_000, k=64)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(68, generator=g)[:64] for _ in range(6)]) * 1024
    ids[:, 9] = ids[:, 4]
    check(zs, ids, lps, normalize=normalize, reduction="none", device=device)


def test_full_vocabulary_ids_give_the_forward_kl(device):
    # K = V with the teacher's own log-probabilities: "full" top-K KL is the forward KL of the logits.
    g = torch.Generator().manual_seed(4)
    zs, zt = torch.randn(6, 50, generator=g).to(device), torch.randn(6, 50, generator=g).to(device)
    lps, ids = torch.log_softmax(zt, -1).topk(50, dim=-1)
    for normalize in NORMALIZE:
        got = nitrobrew.logits.topk_kl(zs, ids, lps, normalize=normalize, reduction="none")
        torch.testing.assert_close(got, nitrobrew.logits.forward_kl(zs, zt, reduction="none"))


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
def test_teacher_entries_of_zero_probability(normalize, beta, device):
    zs, ids, lps, _ = make_topk(v=300, k=10)
    lps[:, ::3] = float("-inf")
    if normalize == "full":  # a row whose teacher kept no mass: 0, and no gradient ("topk": NaN,
        lps[4] = float("-inf")  # test_nonfinite.py)
    if divergence_of(beta) == "reverse_kl":  # KL(p || q) where q = 0 < p: +inf, as the reference has it
        loss = nitrobrew.logits.topk_kl(zs.to(device), ids.to(device), lps.to(device), normalize=normalize,
                                        reduction="none", **divergence_kwargs(beta))
        assert (loss == float("inf")).all()
        return
    check(zs, ids, lps, normalize=normalize, beta=beta, reduction="none", device=device)


def test_teacher_gets_no_gradient_and_ignored_rows_give_zero(device):
    zs, ids, lps, labels = make_topk(lead=(5,), v=40, k=4)
    zs, ids, lps, labels = zs.to(device), ids.to(device), lps.to(device), labels.to(device)
    zs.requires_grad_()
    lps.requires_grad_()
    loss = nitrobrew.logits.topk_kl(zs, ids, lps, labels=torch.full_like(labels, -100))
    loss.backward()
    assert loss.item() == 0.0 and zs.grad.abs().max().item() == 0.0 and lps.grad is None


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda zs, ids, lps: (zs, ids.clamp(max=38) + 2, lps), IndexError,
         r"teacher_ids\[\d+, \d+\] = 40 is outside \[0, V = 40\)"),
        (lambda zs, ids, lps: (zs, ids.index_fill(1, torch.tensor([0]), -1), lps), IndexError,
         r"teacher_ids\[0, 0\] = -1 is outside \[0, V = 40\); 5 of the 20 entries are outside it"),
        (lambda zs, ids, lps: (zs, ids.int(), lps), TypeError, "int64"),
        (lambda zs, ids, lps: (zs, ids, lps[:, :3]), ValueError, "both be"),
        (lambda zs, ids, lps: (zs, ids[:2], lps[:2]), ValueError, "leading shape"),
        (lambda zs, ids, lps: (zs[:, :3], ids, lps), ValueError, "K .* must be in"),
        (lambda zs, ids, lps: (zs, ids, lps.long()), TypeError, "floating point"),
    ],
)
def test_errors(change, error, match):
    zs, ids, lps, _ = make_topk(lead=(5,), v=40, k=4)
    zs, ids, lps = change(zs, ids, lps)
    with pytest.raises(error, match=match):
        nitrobrew.logits.topk_kl(zs, ids, lps)


def test_unknown_normalize_is_an_error():
    zs, ids, lps, _ = make_topk(lead=(5,), v=40, k=4)
    with pytest.raises(ValueError, match="normalize"):
        nitrobrew.logits.topk_kl(zs, ids, lps, normalize="softmax")


@pytest.mark.parametrize("renormalize, divergence, weight",
                         [(False, "forward_kl", 0.0), (True, "forward_kl", 0.0), (True, "skew_reverse_kl", 0.3)])
def test_opcheck(renormalize, divergence, weight, device):
    zs, ids, lps, labels = make_topk(lead=(6,), v=70, k=5, masked_rows=True)
    zs, ids, lps, labels = zs.to(device), ids.to(device), lps.to(device), labels.to(device)
    zs.requires_grad_()
    options = (-100, 1.5, renormalize, divergence, weight)
    torch.library.opcheck(torch.ops.nitrobrew.topk_logits_fwd.default, (zs, ids, lps, labels) + options)
    _, row_stats = torch.ops.nitrobrew.topk_logits_fwd(zs.detach(), ids, lps, labels, *options)
    torch.library.opcheck(torch.ops.nitrobrew.topk_logits_bwd.default,
                          (torch.randn(6, device=device), zs.detach(), ids, lps, labels, row_stats) + options)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_with_backward(dynamic, device):
    zs, ids, lps, labels = make_topk(lead=(8,), v=90, k=6, masked_rows=True)
    zs, ids, lps, labels = zs.to(device), ids.to(device), lps.to(device), labels.to(device)

    def step(a, ids, lps, labels):
        return nitrobrew.logits.topk_kl(a, ids, lps, normalize="topk", temperature=2.0, labels=labels) * 2.0

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (step, compiled):
        a = zs.clone().requires_grad_()
        loss = fn(a, ids, lps, labels)
        loss.backward()
        results.append((loss.detach(), a.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager)


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_non_contiguous_logits(normalize, device):
    # Column-major logits and logits that are a slice of a wider (padded) buffer, read in place.
    zs, ids, lps, _ = make_topk(lead=(9,), v=200, k=8)
    column_major = zs.t().contiguous().t()
    padded = torch.cat([zs, torch.randn(9, 56)], dim=1)[:, :200]
    for z in (column_major, padded):
        assert not z.is_contiguous()
        check(z, ids, lps, normalize=normalize, reduction="none", device=device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_ids_out_of_range_raise_and_leave_the_device_usable(device):
    # An IndexError naming the id and its position, on every device; on CUDA no device-side assertion,
    # so the next call in the same process runs.
    zs, ids, lps, _ = make_topk(lead=(2, 5), v=40, k=4)
    zs, ids, lps = zs.to(device), ids.to(device), lps.to(device)
    bad = ids.clone()
    bad[1, 3, 2] = 40
    with pytest.raises(IndexError, match=r"teacher_ids\[1, 3, 2\] = 40 is outside \[0, V = 40\)"):
        nitrobrew.logits.topk_kl(zs, bad, lps)
    loss = nitrobrew.logits.topk_kl(zs, ids, lps)
    assert torch.isfinite(loss).item()
