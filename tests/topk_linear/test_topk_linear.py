"""nitrobrew.topk_kl (distillation against a teacher's top-K log-probabilities from the student's hidden
states) against the float64 reference: values and gradients for both normalizations and every option,
errors, opcheck and torch.compile, on the CPU and (where there is one) a CUDA device; the oracles run on
the CPU."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
from conftest import CUDA
from helpers import (TOPK_CASES, assert_close_to_oracle, bias_gradient_k, divergence_kwargs, divergence_of,
                     linear_slacks, reference_options, row_weights, topk_tvd_slack)
from nitrobrew import reference

NORMALIZE = ["full", "topk"]


def make_problem(lead=(37,), v=1000, d=24, k=32, *, scale=3.0, dtype=torch.float32, seed=0, masked_rows=False):
    """Student hidden states and unembedding (logits of std ~ scale), and the top-K ids (any order) and
    log-probabilities of a teacher correlated with the student."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(*lead, d, generator=g, dtype=torch.float64)
    ws = torch.randn(v, d, generator=g, dtype=torch.float64) * scale / d**0.5
    zt = xs @ ws.T + torch.randn(*lead, v, generator=g, dtype=torch.float64) * scale * 0.5
    logprobs, ids = torch.log_softmax(zt, -1).topk(k, dim=-1)
    order = torch.argsort(torch.rand(*lead, k, generator=g), dim=-1)
    logprobs, ids = logprobs.gather(-1, order), ids.gather(-1, order)
    labels = torch.randint(0, v, lead, generator=g)
    if masked_rows:
        labels = torch.where(torch.rand(lead, generator=g) < 0.3, torch.full_like(labels, -100), labels)
    return xs.to(dtype), ws.to(dtype), ids, logprobs.float(), labels


def to_device(t, device):
    """t on `device` with the same strides (a plain .to() would make it contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)


def values_and_grads(fn, xs, ws, ids, lps, upstream, bias_s=None, **options):
    """loss, dxs, dws (and dbias_s with a bias)."""
    leaves = [xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()]
    if bias_s is not None:
        bias_s = bias_s.detach().clone().requires_grad_()
        leaves.append(bias_s)
    loss = fn(*leaves[:2], ids, lps, bias_s=bias_s, **options)
    grads = torch.autograd.grad(loss, leaves, upstream.to(loss.dtype).to(loss.device))
    return (loss.detach().cpu(), *(g.cpu() for g in grads))


def check(xs, ws, ids, lps, *, k=2.0, rel_floor=1e-6, loss_floor=0.0, device="cpu", chunk_V=None,
          grad_in_forward=None, grad_chunk_mib=None, beta=0.0, **options):
    """nitrobrew on `device` vs the float64 oracle, within k x the error of the reference in the
    precision nitrobrew accumulates in (float32, float64 for float64 inputs). Inputs are CPU tensors.
    chunk_V, grad_in_forward and grad_chunk_mib are nitrobrew's alone (the path it takes); beta: the
    divergence, as helpers.divergence_of names it."""
    reduction = options.get("reduction", "mean")
    shape = xs.shape[:-1] if reduction == "none" else ()
    upstream = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    same = torch.float64 if xs.dtype == torch.float64 else torch.float32
    if device == "cuda" and xs.dtype in (torch.bfloat16, torch.float16):
        k = max(k, 4.0)  # the CUDA backward rounds dLoss/dz to the inputs' dtype for its GEMMs (helpers.py)

    def ref(a, w, i, lp, **kw):
        return reference.topk_linear(a, w, i, lp, dtype=None, **reference_options(beta), **kw)

    on_device = {key: (v.to(device) if isinstance(v, torch.Tensor) else v) for key, v in options.items()}
    ours = values_and_grads(nitrobrew.topk_kl, to_device(xs, device), to_device(ws, device), ids.to(device),
                            lps.to(device), upstream, chunk_V=chunk_V, grad_in_forward=grad_in_forward,
                            grad_chunk_mib=grad_chunk_mib, **on_device, **divergence_kwargs(beta))

    def in_dtype(dtype):
        return {key: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for key, v in options.items()}

    oracle = values_and_grads(ref, xs.double(), ws.double(), ids, lps.double(), upstream, **in_dtype(torch.float64))
    same_precision = values_and_grads(ref, xs.to(same), ws.to(same), ids, lps.to(same), upstream, **in_dtype(same))
    assert ours[0].dtype == same and ours[1].dtype == xs.dtype and ours[2].dtype == ws.dtype
    assert len(ours) == len(oracle)
    what = f"normalize={options.get('normalize', 'full')} {divergence_kwargs(beta)}"
    k_bias = bias_gradient_k(torch.empty(0, dtype=xs.dtype, device=device), k)
    slacks = [None] * len(ours)
    if divergence_of(beta) == "tvd":
        bias = options.get("bias_s")
        zs = reference.model_logits(xs.double(), ws.double(), bias=None if bias is None else bias.double(),
                                    logit_scale=options.get("logit_scale_s", 1.0))
        weights = row_weights(upstream, xs.shape[:-1], options.get("labels"), reduction)
        dz = topk_tvd_slack(zs, ids, lps.double(), weights, xs.dtype, options.get("temperature", 1.0))
        slacks[1:] = linear_slacks(dz * abs(options.get("logit_scale_s", 1.0)), xs, ws, bias)
    for name, a, o, s, slack in zip(("loss", "dxs", "dws", "dbias_s"), ours, oracle, same_precision, slacks):
        assert_close_to_oracle(a, o, s, k=k_bias if name == "dbias_s" else k, rel_floor=rel_floor,
                               abs_floor=loss_floor if name == "loss" else 0.0, slack=slack, what=f"{name} {what}")


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("k", [1, 7, 128])
def test_values_and_gradients(normalize, beta, reduction, k, device):
    xs, ws, ids, lps, labels = make_problem(k=k, masked_rows=True)
    check(xs, ws, ids, lps, normalize=normalize, beta=beta, reduction=reduction, labels=labels, device=device)


@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("chunk_V", [1, 300, 999])
def test_vocabulary_chunks(normalize, chunk_V, device):
    # Several chunks, the last one partial (the CUDA backward rounds its chunks up to 768 entries).
    xs, ws, ids, lps, labels = make_problem(lead=(19,), v=1700, k=16, masked_rows=True)
    check(xs, ws, ids, lps, normalize=normalize, reduction="none", labels=labels, chunk_V=chunk_V, device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 20, 328])
def test_dtypes_and_hidden_sizes(normalize, beta, dtype, d, device):
    # d = 64 and 328 take the sm_90a kernels on Hopper (328: 11 K slabs of 32, more than its ring
    # holds); d = 20 rows are not 16-byte multiples (mma.sync, scalar loads).
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 inputs have CPU kernels only (test_float64_is_an_error_on_cuda)")
    xs, ws, ids, lps, _ = make_problem(lead=(3, 45), v=1100, d=d, k=16, dtype=dtype)
    floor = torch.finfo(dtype).eps if dtype != torch.float64 else 1e-6  # one output rounding step
    check(xs, ws, ids, lps, normalize=normalize, beta=beta, reduction="none", rel_floor=floor, device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sm_90a kernels' tiling; CPU covered above")
def test_cuda_several_tiles_per_block():
    # 2 row blocks x ~79 vocabulary tiles: each sm_90a block walks 2 tiles, folding the first while the
    # second's product runs, one of 33 pieces per K slab of 32 (11 here: the rest after the product);
    # the last tile is partial. (With K = 1100 the loss is off by ~9x float32's error, as before this
    # fold order: the tensor-core logits' rounding over long products, docs/notes/topk_linear.md.)
    xs, ws, ids, lps, labels = make_problem(lead=(130,), v=20011, d=328, k=16, dtype=torch.bfloat16, masked_rows=True)
    check(xs, ws, ids, lps, normalize="full", reduction="none", labels=labels, device="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ids_at_tile_edges_and_many_per_tile(dtype, device):
    # normalize="full" picks the K student logits out of the vocabulary tiles of its pass (256 wide on
    # sm_90a, 64 on sm_80, chunks on the CPU): ids on both sides of tile edges, the first and last
    # vocabulary entries, repeated ids, and K = 700 of V = 1537 (most of a tile's entries in one row)
    # must each be picked at their own positions, and masked rows not at all.
    v, k, rows = 1537, 700, 150
    xs, ws, _, _, labels = make_problem(lead=(rows,), v=v, d=64, k=1, dtype=dtype, masked_rows=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(rows)])
    ids[:, :9] = torch.tensor([0, 63, 64, 255, 256, 511, 512, 1535, 1536])
    ids[5, 100:120] = ids[5, 0]
    ids = ids.gather(1, torch.argsort(torch.rand(rows, k, generator=g), dim=1))
    lps = torch.log_softmax(torch.randn(rows, v, generator=g, dtype=torch.float64) * 3, -1).gather(1, ids).float()
    check(xs, ws, ids, lps, normalize="full", reduction="none", labels=labels, device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("bias,logit_scale", [(True, 1.0), (False, 0.0625), (True, 2.5)])
@pytest.mark.parametrize("masked,reduction", [(False, "mean"), (True, "none")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_and_logit_scale(normalize, beta, bias, logit_scale, masked, reduction, dtype, device):
    # A student with an lm_head bias (std 2 in logit units) and Cohere's or Granite's logit multiplier.
    if device == "cpu" and dtype == torch.bfloat16:
        dtype = torch.float64
    xs, ws, ids, lps, labels = make_problem(k=20, masked_rows=masked, dtype=dtype, v=700)
    bias_s = (torch.randn(700, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 2).to(dtype)
    rel_floor = 1e-12 if dtype == torch.float64 else 1e-6
    check(xs, ws, ids, lps, normalize=normalize, beta=beta, reduction=reduction, labels=labels if masked else None,
          temperature=0.8, bias_s=bias_s if bias else None, logit_scale_s=logit_scale, device=device,
          rel_floor=rel_floor, chunk_V=96)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
@pytest.mark.parametrize("temperature,scale", [(0.1, 3.0), (1.0, 30.0), (10.0, 3.0), (2.0, 1e-3)])
def test_temperatures_and_logit_scales(normalize, beta, temperature, scale, device):
    xs, ws, ids, lps, _ = make_problem(v=500, k=20, scale=scale)
    check(xs, ws, ids, lps, normalize=normalize, beta=beta, temperature=temperature, reduction="sum", device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
def test_repeated_ids(normalize, beta, device):
    # An id listed twice counts twice (as in the reference's gather); its dLoss/dz entry holds both terms.
    xs, ws, ids, lps, _ = make_problem(v=300, k=12)
    ids[:, 5] = ids[:, 2]
    ids[3, 7:] = ids[3, 0]
    check(xs, ws, ids, lps, normalize=normalize, beta=beta, reduction="none", device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
def test_teacher_entries_of_zero_probability(normalize, beta, device):
    xs, ws, ids, lps, _ = make_problem(v=300, k=10)
    lps[:, ::3] = float("-inf")
    if normalize == "full":  # a row whose teacher kept no mass: 0, and no gradient ("topk": NaN,
        lps[4] = float("-inf")  # test_nonfinite.py)
    if divergence_of(beta) == "reverse_kl":  # KL(p || q) where q = 0 < p: +inf, as the reference has it
        loss = nitrobrew.topk_kl(xs.to(device), ws.to(device), ids.to(device), lps.to(device), normalize=normalize,
                                 reduction="none", **divergence_kwargs(beta))
        assert (loss == float("inf")).all()
        return
    check(xs, ws, ids, lps, normalize=normalize, beta=beta, reduction="none", device=device)


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
def test_matches_the_loss_from_logits(normalize, beta, device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    xs, ws, ids, lps, labels = make_problem(lead=(4, 7), v=600, k=9, masked_rows=True, dtype=dtype)
    xs, ws, ids, lps, labels = (t.to(device) for t in (xs, ws, ids, lps, labels))
    options = dict(normalize=normalize, temperature=1.7, reduction="none", labels=labels, **divergence_kwargs(beta))
    tolerance = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)  # two float32 products of the logits
    torch.testing.assert_close(nitrobrew.topk_kl(xs, ws, ids, lps, **options),
                               nitrobrew.logits.topk_kl(xs @ ws.T, ids, lps, **options).to(dtype), **tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_float64_is_an_error_on_cuda():
    xs, ws, ids, lps, _ = make_problem(lead=(5,), v=40, k=4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float64 inputs are supported on the CPU only"):
        nitrobrew.topk_kl(xs.cuda(), ws.cuda(), ids.cuda(), lps.cuda())


def test_teacher_gets_no_gradient_and_ignored_rows_give_zero(device):
    xs, ws, ids, lps, labels = make_problem(lead=(5,), v=40, k=4)
    xs, ws, ids, lps, labels = (t.to(device) for t in (xs, ws, ids, lps, labels))
    xs.requires_grad_()
    ws.requires_grad_()
    lps.requires_grad_()
    loss = nitrobrew.topk_kl(xs, ws, ids, lps, labels=torch.full_like(labels, -100))
    loss.backward()
    assert loss.item() == 0.0 and lps.grad is None
    assert xs.grad.abs().max().item() == 0.0 and ws.grad.abs().max().item() == 0.0


@pytest.mark.parametrize("wanted", ["xs", "ws"])
def test_one_gradient(wanted, device):
    xs, ws, ids, lps, _ = make_problem(lead=(11,), v=200, k=5)
    xs, ws, ids, lps = (t.to(device) for t in (xs, ws, ids, lps))
    xs_, ws_ = xs.clone().requires_grad_(wanted == "xs"), ws.clone().requires_grad_(wanted == "ws")
    (grad,) = torch.autograd.grad(nitrobrew.topk_kl(xs_, ws_, ids, lps), xs_ if wanted == "xs" else ws_)
    xs2, ws2 = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    both = torch.autograd.grad(nitrobrew.topk_kl(xs2, ws2, ids, lps), (xs2, ws2))
    torch.testing.assert_close(grad, both[0] if wanted == "xs" else both[1])


@pytest.mark.parametrize("normalize, beta", TOPK_CASES)
def test_non_contiguous_inputs(normalize, beta, device):
    # A transposed xs and a ws that is a slice of a wider buffer.
    xs, ws, ids, lps, _ = make_problem(lead=(9,), v=300, d=32, k=8)
    xs_t = xs.t().contiguous().t()
    ws_padded = torch.cat([ws, torch.randn(300, 8)], dim=1)[:, :32]
    assert not xs_t.is_contiguous() and not ws_padded.is_contiguous()
    check(xs_t, ws_padded, ids, lps, normalize=normalize, beta=beta, reduction="none", device=device)


def test_under_autocast(device):
    xs, ws, ids, lps, _ = make_problem(lead=(6,), v=128, d=32, k=8)
    xs, ws, ids, lps = (t.to(device) for t in (xs, ws, ids, lps))
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = nitrobrew.topk_kl(xs, ws, ids, lps)
    torch.testing.assert_close(loss, nitrobrew.topk_kl(xs.bfloat16(), ws.bfloat16(), ids, lps))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda xs, ws, ids, lps: (xs, ws, ids.clamp(max=38) + 2, lps), IndexError,
         r"teacher_ids\[\d+, \d+\] = 40 is outside \[0, V = 40\)"),
        (lambda xs, ws, ids, lps: (xs, ws, ids.index_fill(1, torch.tensor([0]), -1), lps), IndexError,
         r"teacher_ids\[0, 0\] = -1 is outside \[0, V = 40\); 5 of the 20 entries are outside it\. A negative id "
         r"usually marks padding: leave such positions out of the loss with labels equal to ignore_index"),
        (lambda xs, ws, ids, lps: (torch.randn(xs.shape[0], 40), ws, ids, lps), ValueError,
         r"last dimension is the vocabulary size V = 40: for logits, use nitrobrew.logits"),
        (lambda xs, ws, ids, lps: (xs, ws, ids.int(), lps), TypeError, "int64"),
        (lambda xs, ws, ids, lps: (xs, ws, ids, lps[:, :3]), ValueError, "both be"),
        (lambda xs, ws, ids, lps: (xs, ws, ids[:2], lps[:2]), ValueError, "leading shape"),
        (lambda xs, ws, ids, lps: (xs, ws[:3], ids, lps), ValueError, "K .* must be in"),
        (lambda xs, ws, ids, lps: (xs, ws, ids, lps.long()), TypeError, "floating point"),
        (lambda xs, ws, ids, lps: (xs, ws.double(), ids, lps), TypeError, "share one dtype"),
        (lambda xs, ws, ids, lps: (xs, ws[:, :5], ids, lps), ValueError, r"ws \[V, D\]"),
    ],
)
def test_errors(change, error, match):
    xs, ws, ids, lps, _ = make_problem(lead=(5,), v=40, k=4)
    xs, ws, ids, lps = change(xs, ws, ids, lps)
    with pytest.raises(error, match=match):
        nitrobrew.topk_kl(xs, ws, ids, lps)


@pytest.mark.parametrize("normalize", ["full", "topk"])
def test_masked_rows_ids_are_not_read(normalize, device):
    # Padded positions often carry ids of -1: with labels masking them, the loss and gradients are those of any
    # valid ids there, in both families; an unmasked row's -1 still raises.
    xs, ws, ids, lps, labels = make_problem(lead=(11,), v=90, d=16, k=6, masked_rows=True)
    masked = labels == -100
    assert masked.any() and not masked.all()
    padded = torch.where(masked.unsqueeze(-1), torch.full_like(ids, -1), ids)
    xs, ws, ids, padded, lps, labels = (t.to(device) for t in (xs, ws, ids, padded, lps, labels))
    for loss_of, inputs in ((lambda x, w, i: nitrobrew.topk_kl(x, w, i, lps, normalize=normalize, labels=labels,
                                                               reduction="sum"), (xs, ws)),
                            (lambda z, i: nitrobrew.logits.topk_kl(z, i, lps, normalize=normalize, labels=labels,
                                                                    reduction="sum"), (xs @ ws.T,))):
        results = []
        for teacher_ids in (ids, padded):
            leaves = [t.detach().requires_grad_() for t in inputs]
            loss = loss_of(*leaves, teacher_ids)
            results.append((loss.detach(), *torch.autograd.grad(loss, leaves)))
        for got, expected in zip(results[1], results[0]):  # not bitwise: CUDA's scatters add in any order
            torch.testing.assert_close(got, expected)
        unmasked = torch.where(labels != -100)[0][0]
        bad = ids.clone()
        bad[unmasked, 0] = -1
        with pytest.raises(IndexError, match=rf"teacher_ids\[{int(unmasked)}, 0\] = -1 is outside"):
            loss_of(*inputs, bad)


def test_teacher_mass_above_one_is_an_error(device):
    # Probabilities, or logits, passed as log-probabilities: with normalize="full" (q as given) the loss would mean
    # nothing. "topk" renormalizes over the K ids, so any logits do there; masked rows are not read.
    xs, ws, ids, lps, labels = make_problem(lead=(7,), v=60, d=16, k=5, masked_rows=True)
    xs, ws, ids, lps, labels = (t.to(device) for t in (xs, ws, ids, lps, labels))
    zs = xs @ ws.T
    big_logits = lps.clone()
    big_logits[1] = torch.tensor([95.0, 3.0, 2.0, 1.0, 0.0])  # exp overflows float32: still refused
    for bad in (lps.exp(), lps + 2.0, big_logits):
        with pytest.raises(ValueError, match=r'teacher_logprobs must be log-probabilities: with normalize="full" '
                                             r"the probabilities exp\(teacher_logprobs\) of a row sum to at most 1"):
            nitrobrew.topk_kl(xs, ws, ids, bad)
        with pytest.raises(ValueError, match="teacher_logprobs must be log-probabilities"):
            nitrobrew.logits.topk_kl(zs, ids, bad)
        assert torch.isfinite(nitrobrew.topk_kl(xs, ws, ids, bad, normalize="topk"))
    masked = labels == -100
    garbage = torch.where(masked.unsqueeze(-1), lps + 5.0, lps)
    torch.testing.assert_close(nitrobrew.topk_kl(xs, ws, ids, garbage, labels=labels),
                               nitrobrew.topk_kl(xs, ws, ids, lps, labels=labels))
    # bf16 log-probabilities of a whole high-entropy vocabulary (K = V) sum past 1 by their rounding: accepted.
    zt = (torch.randn(6, 3000, generator=torch.Generator().manual_seed(5)) * 0.5).to(device)
    lp_all, ids_all = zt.bfloat16().log_softmax(-1).topk(3000, dim=-1)
    assert torch.logsumexp(lp_all.double(), -1).max() > 0  # past 1, as the check's slack allows for
    assert torch.isfinite(nitrobrew.logits.topk_kl(torch.randn(6, 3000, device=device), ids_all, lp_all))
    # A row of a non-finite mass follows the non-finite rule (a NaN row), not this error.
    inf_row = lps.clone()
    inf_row[1, 0] = float("inf")
    assert torch.isnan(nitrobrew.topk_kl(xs, ws, ids, inf_row, reduction="none")[1])


@pytest.mark.parametrize("options, error, match", [
    (dict(bias_s=torch.zeros(39)), ValueError, r"bias_s must be \[V\] with one entry per row of ws \(40\)"),
    (dict(bias_s=torch.zeros(40, dtype=torch.int32)), TypeError, "bias_s must be float32"),
    (dict(logit_scale_s=0.0), ValueError, "logit_scale_s must be a positive"),
    (dict(logit_scale_s=float("inf")), ValueError, "logit_scale_s must be a positive"),
])
def test_bias_and_logit_scale_errors(options, error, match):
    xs, ws, ids, lps, _ = make_problem(lead=(5,), v=40, k=4)
    with pytest.raises(error, match=match):
        nitrobrew.topk_kl(xs, ws, ids, lps, **options)


def test_ignore_index_must_be_an_int():
    xs, ws, ids, lps, _ = make_problem(lead=(5,), v=40, k=4)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        nitrobrew.topk_kl(xs, ws, ids, lps, ignore_index=1.5)
    zs = xs @ ws.T
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        nitrobrew.logits.topk_kl(zs, ids, lps, ignore_index=True)


def test_unknown_normalize_is_an_error():
    xs, ws, ids, lps, _ = make_problem(lead=(5,), v=40, k=4)
    with pytest.raises(ValueError, match="normalize"):
        nitrobrew.topk_kl(xs, ws, ids, lps, normalize="softmax")


def test_op_rejects_ids_out_of_range_on_the_cpu():
    xs, ws, ids, lps, _ = make_problem(lead=(5,), v=40, k=4)
    with pytest.raises(RuntimeError, match=r"teacher_ids must be in \[0, V = 40\)"):
        torch.ops.nitrobrew.topk_linear_fwd(xs, ws, ids + 40, lps, None, None, -100, 1.0, 1.0, False, 0,
                                            "forward_kl", 0.0)


@pytest.mark.parametrize("renormalize, divergence, weight",
                         [(False, "forward_kl", 0.0), (True, "forward_kl", 0.0), (True, "jsd", 0.3)])
@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(renormalize, divergence, weight, bias, device):
    xs, ws, ids, lps, labels = make_problem(lead=(6,), v=70, k=5, masked_rows=True)
    xs, ws, ids, lps, labels = (t.to(device) for t in (xs, ws, ids, lps, labels))
    bias_s = torch.randn(70, device=device).requires_grad_() if bias else None
    xs.requires_grad_()
    ws.requires_grad_()
    args = (ids, lps, labels, bias_s, -100, 1.5, 0.7 if bias else 1.0, renormalize, 0, divergence, weight)
    torch.library.opcheck(torch.ops.nitrobrew.topk_linear_fwd.default, (xs, ws) + args)
    bias_s = None if bias_s is None else bias_s.detach()
    args = (ids, lps, labels, bias_s, -100, 1.5, 0.7 if bias else 1.0, renormalize, 0, divergence, weight)
    _, row_stats = torch.ops.nitrobrew.topk_linear_fwd(xs.detach(), ws.detach(), *args)
    for compute in ((True, True, True), (True, False, False), (False, True, False), (False, False, True)):
        torch.library.opcheck(torch.ops.nitrobrew.topk_linear_bwd.default,
                              (torch.randn(6, device=device), xs.detach(), ws.detach(), ids, lps, labels, bias_s,
                               row_stats, *args[4:], *compute))


@pytest.mark.parametrize("grad_in_forward", [None, True])  # automatic (the recompute path while compiling), training
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_with_backward(dynamic, grad_in_forward, device):
    xs, ws, ids, lps, labels = make_problem(lead=(2, 4), v=90, k=6, masked_rows=True)
    xs, ws, ids, lps, labels = (t.to(device) for t in (xs, ws, ids, lps, labels))

    bias_s = torch.randn(90, device=device)

    def step(a, w, ids, lps, labels, b):
        return nitrobrew.topk_kl(a, w, ids, lps, temperature=2.0, labels=labels, bias_s=b, logit_scale_s=0.5,
                                 grad_in_forward=grad_in_forward) * 2.0

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (step, compiled):
        a, w, b = xs.clone().requires_grad_(), ws.clone().requires_grad_(), bias_s.clone().requires_grad_()
        loss = fn(a, w, ids, lps, labels, b)
        loss.backward()
        results.append((loss.detach(), a.grad, w.grad, b.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_ids_out_of_range_raise_and_leave_the_device_usable(device):
    # An IndexError naming the id and its position, on every device; on CUDA no device-side assertion,
    # so the next call in the same process runs.
    xs, ws, ids, lps, _ = make_problem(lead=(2, 5), v=40, k=4)
    xs, ws, ids, lps = (t.to(device) for t in (xs, ws, ids, lps))
    if device == "cuda":
        xs, ws = xs.bfloat16(), ws.bfloat16()
    for normalize in ("full", "topk"):
        bad = ids.clone()
        bad[0, 4, 1] = -3
        with pytest.raises(IndexError, match=r"teacher_ids\[0, 4, 1\] = -3 is outside \[0, V = 40\)"):
            nitrobrew.topk_kl(xs, ws, bad, lps, normalize=normalize)
        loss = nitrobrew.topk_kl(xs, ws, ids, lps, normalize=normalize)
        assert torch.isfinite(loss).item()


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_bias_gradient_alone(normalize, device):
    # Only bias_s wants a gradient: the backward skips dxs and dws (on CUDA "topk" runs the id-run kernel
    # without its dws rows) and must give the same bias gradient as when all three are wanted.
    xs, ws, ids, lps, labels = make_problem(k=9, masked_rows=True, v=300)
    xs, ws, ids, lps, labels = (t.to(device) for t in (xs, ws, ids, lps, labels))
    bias = torch.randn(300, device=device)
    options = dict(normalize=normalize, labels=labels, logit_scale_s=0.7)
    b_alone = bias.clone().requires_grad_()
    nitrobrew.topk_kl(xs, ws, ids, lps, bias_s=b_alone, **options).backward()
    a, w, b_all = xs.clone().requires_grad_(), ws.clone().requires_grad_(), bias.clone().requires_grad_()
    nitrobrew.topk_kl(a, w, ids, lps, bias_s=b_all, **options).backward()
    assert b_alone.grad.abs().max() > 0
    torch.testing.assert_close(b_alone.grad, b_all.grad)
