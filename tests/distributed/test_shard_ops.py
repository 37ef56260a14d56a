"""The vocabulary shards' ops in one process (no process group): the loss's vocabulary cut into
uneven shards, each shard's forward (fused_linear_shard, logits_shard) with its own labels, the
states merged (merge_shards) and each shard's backward from the merged statistics give the
single-device op's loss, row statistics and gradients. On CUDA this checks the kernels' handling of
shards (offsets, partial states, vocab_size inside a shard); the sanitize case runs them under
compute-sanitizer (tools/gpu/check.sh)."""

import pytest
import torch

from conftest import CUDA
from nitrobrew.distributed import _EMPTY_PARTIAL, NUM_PARTIAL_FIELDS, FusedLinearCall, _local_labels, _Shard

ops = torch.ops.nitrobrew
V, ROWS = 300, 310  # 10 padded rows
BOUNDS = [0, 40, 41, 200, 290, ROWS]  # uneven shards; vocab_size falls inside the fourth, the last is padding

CASES = [  # entropy: the student's entropy states in the shards' partials, finished by the merge
    FusedLinearCall("forward_kl", 0.0, 1.0),
    FusedLinearCall("reverse_kl", 1.0, 0.7, ce_weight=0.5, softcap_s=6.0, entropy=True),
    FusedLinearCall("jsd", 0.3, 1.5, ce_weight=1.0, logit_scale_s=0.8, softcap_t=8.0, entropy=True),
    FusedLinearCall("jsd", 0.6, 1.0),
]
CASE_ID = lambda c: f"{c.divergence}-{c.beta}-ce{c.ce_weight}" + ("-entropy" if c.entropy else "")  # noqa: E731


def _problem(device, dtype, n=70, d_s=40, d_t=56):
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, d_s, generator=g)
    xt = torch.randn(n, d_t, generator=g)
    ws = torch.randn(ROWS, d_s, generator=g) * 3 / d_s**0.5
    wt = torch.randn(ROWS, d_t, generator=g) * 3 / d_t**0.5
    bias_s, bias_t = torch.randn(ROWS, generator=g), torch.randn(ROWS, generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[::5] = -100
    floats = [t.to(device=device, dtype=dtype) for t in (xs, xt, ws, wt, bias_s, bias_t)]
    return (*floats, labels.to(device))


def _shards_fused_linear(call, xs, xt, ws, wt, bias_s, bias_t, labels, grad):
    """Loss, row_stats and (dxs, dws, dbias) of the shards, merged as nitrobrew.distributed merges them."""
    parts, locals_ = [], []
    for start, stop in zip(BOUNDS[:-1], BOUNDS[1:]):
        real = max(0, min(V - start, stop - start))
        local = _local_labels(labels, _Shard(None, start, stop - start, ROWS, 0, 0, ROWS), real, call.ignore_index)
        args = (xs, xt, ws[start:stop], wt[start:stop], local, bias_s[start:stop], bias_t[start:stop])
        locals_.append((real, args))
        if real == 0:
            dtype = torch.float64 if xs.dtype == torch.float64 else torch.float32
            parts.append(torch.tensor(_EMPTY_PARTIAL, dtype=dtype, device=xs.device).expand(xs.shape[0], NUM_PARTIAL_FIELDS))
        else:
            parts.append(ops.fused_linear_shard(*args, None, *call.op_options(real), call.entropy))
    parts = torch.stack(parts)
    merge = (labels, call.ignore_index, call.divergence, call.beta, call.ce_weight, V)
    loss, row_stats = ops.merge_shards(parts, None, *merge)
    if call.uses_mixture():
        mixtures = torch.stack([
            ops.fused_linear_shard(*args, row_stats, *call.op_options(real)) if real else
            torch.zeros(xs.shape[0], 2, dtype=torch.float64, device=xs.device) for real, args in locals_])
        loss, row_stats = ops.merge_shards(parts, mixtures, *merge)
    dxs, dws, dbias = torch.zeros_like(xs, dtype=torch.float64 if xs.dtype == torch.float64 else torch.float32), [], []
    for real, args in locals_:
        if real == 0:
            dws.append(torch.zeros_like(args[2]))
            dbias.append(torch.zeros_like(args[5]))
            continue
        d = ops.fused_linear_bwd(grad, *args, row_stats, *call.op_options(real), True, True, True)
        dxs += d[0].to(dxs.dtype)
        dws.append(d[1])
        dbias.append(d[2])
    return loss, row_stats, (dxs, torch.cat(dws), torch.cat(dbias))


def _check(device, dtype, call):
    xs, xt, ws, wt, bias_s, bias_t, labels = _problem(device, dtype)
    grad = torch.rand(xs.shape[0], device=device)
    whole_options = call.op_options(V)
    loss, row_stats = ops.fused_linear_fwd(xs, xt, ws, wt, labels, bias_s, bias_t, *whole_options, call.entropy)
    grads = ops.fused_linear_bwd(grad, xs, xt, ws, wt, labels, bias_s, bias_t, row_stats, *whole_options,
                                 True, True, True)
    s_loss, s_stats, s_grads = _shards_fused_linear(call, xs, xt, ws, wt, bias_s, bias_t, labels, grad)
    exact = dtype == torch.float64
    rtol = 1e-12 if exact else 2e-5
    torch.testing.assert_close(s_loss, loss, rtol=rtol, atol=rtol * loss.abs().max().item())
    # Every column, the student's entropy included where the call asks for it (else 0 on both sides).
    torch.testing.assert_close(s_stats, row_stats, rtol=rtol, atol=rtol * row_stats.abs().max().item())
    assert (row_stats[:, -1] != 0).any() == call.entropy
    for name, a, b in zip(("dxs", "dws", "dbias_s"), s_grads, grads):
        # 16-bit gradients: each shard's dxs comes back rounded to the inputs' dtype before the sum.
        tol = rtol if exact or dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(a.to(b.dtype).float(), b.float(), rtol=tol, atol=tol * b.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("call", CASES, ids=CASE_ID)
def test_fused_linear_shards_merge_to_the_whole_cpu(call):
    _check("cpu", torch.float64, call)


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float64),
                                          pytest.param("cuda", torch.bfloat16, marks=CUDA),
                                          pytest.param("cuda", torch.float32, marks=CUDA)])
@pytest.mark.parametrize("call", CASES, ids=CASE_ID)
def test_product_ops_merge_to_the_whole(call, device, dtype):
    # The training path's stages over shards: each shard's stored products (products), their row states
    # (product_partials) merged, JSD's mixture sums, then each shard's G (product_grads) times a row scale;
    # G . ws summed over the shards and G^T . xs per shard are the recompute path's gradients.
    xs, xt, ws, wt, bias_s, bias_t, labels = _problem(device, dtype)
    whole_options = call.op_options(V)
    loss, row_stats = ops.fused_linear_fwd(xs, xt, ws, wt, labels, bias_s, bias_t, *whole_options, call.entropy)
    scale = torch.tensor(0.37, dtype=loss.dtype, device=device)
    dxs, dws, dbias = ops.fused_linear_bwd(scale.expand(xs.shape[0]).contiguous(), xs, xt, ws, wt, labels, bias_s,
                                           bias_t, row_stats, *whole_options, True, True, True)
    shards, parts = [], []
    for start, stop in zip(BOUNDS[:-1], BOUNDS[1:]):
        real = max(0, min(V - start, stop - start))
        if real == 0:
            continue
        local = _local_labels(labels, _Shard(None, start, stop - start, ROWS, 0, 0, ROWS), real, call.ignore_index)
        rows = (ops.products(xs, ws[start:stop], real), ops.products(xt, wt[start:stop], real), local,
                bias_s[start:stop], bias_t[start:stop])
        shards.append((start, real, rows))
        parts.append(ops.product_partials(*rows, None, *call.op_options(real)[:-2], dtype, call.entropy))
    merge = (labels, call.ignore_index, call.divergence, call.beta, call.ce_weight, V)
    s_loss, s_stats = ops.merge_shards(torch.cat(parts), None, *merge)
    if call.uses_mixture():
        mixtures = [ops.product_partials(*rows, s_stats, *call.op_options(real)[:-2], dtype)
                    for _, real, rows in shards]
        s_loss, s_stats = ops.merge_shards(torch.cat(parts), torch.cat(mixtures), *merge)
    # float64: exact to rounding; CUDA: the products from cuBLAS against the walk's own tiles, and G
    # rounded to 16 bits (the recompute path rounds its dLoss/dz chunks alike).
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    gtol = 1e-10 if dtype == torch.float64 else (2e-4 if dtype == torch.float32 else 2 ** -7)
    torch.testing.assert_close(s_loss, loss, rtol=rtol, atol=rtol * loss.abs().max().item())
    torch.testing.assert_close(s_stats, row_stats, rtol=rtol, atol=rtol * row_stats.abs().max().item())
    s_dxs = torch.zeros_like(dxs, dtype=torch.float64)
    dxs_terms = torch.zeros_like(s_dxs)
    for start, real, rows in shards:
        g = ops.product_grads(*rows, s_stats, scale, *call.op_options(real)[:-2], dtype)
        assert g.dtype == (dtype if device == "cuda" else torch.float64)
        assert g.shape == (xs.shape[0], real) and g.stride(0) == (real + 7) // 8 * 8
        g = g.double()
        s_dxs += g @ ws[start:start + real].double()
        dxs_terms += g.abs() @ ws[start:start + real].double().abs()
        # G rounded to 16 bits errs relative to each entry, and the sums over tokens may cancel: each sum is
        # held to its terms' magnitude (a one-column shard's dbias can be far smaller than its terms).
        sums = (("dws", g.t() @ xs.double(), dws[start:start + real], g.abs().t() @ xs.double().abs()),
                ("dbias", g.sum(0), dbias[start:start + real], g.abs().sum(0)))
        for name, a, b, terms in sums:
            torch.testing.assert_close(a, b.double(), rtol=gtol, atol=gtol * terms.max().item(),
                                       msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(s_dxs, dxs.double(), rtol=gtol, atol=gtol * dxs_terms.max().item())


def test_product_ops_reject_bad_inputs():
    z = torch.randn(4, 10)
    options = (-100, "forward_kl", 0.0, 1.0, 0.0, None, None, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="zs and zt must be \\[N, V\\] of one shape"):
        ops.product_partials(z, torch.randn(4, 9), None, None, None, None, *options, torch.float32)
    with pytest.raises(RuntimeError, match="zs and zt must be float32"):
        ops.product_partials(z.half(), z.half(), None, None, None, None, *options, torch.float16)
    with pytest.raises(RuntimeError, match="bias_s and bias_t must be"):
        ops.product_partials(z, z, None, torch.zeros(9), None, None, *options, torch.float32)
    with pytest.raises(RuntimeError, match="zs must be in the accumulation dtype of Double inputs"):
        ops.product_partials(z, z, None, None, None, None, *options, torch.float64)
    with pytest.raises(RuntimeError, match="row_stats must be \\[N, 8\\]"):
        ops.product_grads(z, z, None, None, None, torch.zeros(4, 3), torch.tensor(1.0), *options, torch.bfloat16)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("call", CASES, ids=CASE_ID)
def test_fused_linear_shards_merge_to_the_whole_cuda(call, dtype):
    _check("cuda", dtype, call)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.4)])
def test_logits_shards_merge_to_the_whole(device, divergence, beta):
    g = torch.Generator().manual_seed(1)
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    zs = (torch.randn(33, V, generator=g) * 4).to(device=device, dtype=dtype)
    zt = (torch.randn(33, V, generator=g) * 4).to(device=device, dtype=dtype)
    zs[:, 50:120] = zt[:, 50:120] = float("-inf")  # a masked range spanning a whole shard
    labels = torch.randint(0, V, (33,), generator=g).to(device)
    labels[::3] = -100
    options = (-100, divergence, beta, 1.3)
    bounds = [0, 41, 120, 121, V]
    loss, row_stats = ops.logits_fwd(zs, zt, labels, *options)
    parts = torch.stack([ops.logits_shard(zs[:, a:b], zt[:, a:b], labels, None, *options)
                         for a, b in zip(bounds[:-1], bounds[1:])])
    merge = (labels, -100, divergence, beta, 0.0, V)
    s_loss, s_stats = ops.merge_shards(parts, None, *merge)
    if divergence == "jsd":
        mixtures = torch.stack([ops.logits_shard(zs[:, a:b], zt[:, a:b], labels, s_stats, *options)
                                for a, b in zip(bounds[:-1], bounds[1:])])
        s_loss, s_stats = ops.merge_shards(parts, mixtures, *merge)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(s_loss, loss, rtol=rtol, atol=rtol * loss.abs().max().item())
    grad = torch.rand(33, device=device, dtype=loss.dtype)
    dzs = ops.logits_bwd(grad, zs, zt, labels, row_stats, *options)
    s_dzs = torch.cat([ops.logits_bwd(grad, zs[:, a:b], zt[:, a:b], labels, s_stats, *options)
                       for a, b in zip(bounds[:-1], bounds[1:])], 1)
    tol = rtol if dtype == torch.float64 else 2 ** -7
    torch.testing.assert_close(s_dzs.float(), dzs.float(), rtol=tol, atol=tol * dzs.float().abs().max().item())


@CUDA
@pytest.mark.sanitize
def test_every_shard_kernel_once():
    for dtype in (torch.bfloat16, torch.float32):
        for call in CASES:
            _check("cuda", dtype, call)
            test_product_ops_merge_to_the_whole(call, "cuda", dtype)  # the training path's stages
    torch.cuda.synchronize()
