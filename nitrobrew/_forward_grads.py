"""The training path: a loss's gradients formed during its forward, its backward only scaling them.

Two losses take it: the fused-linear ones (nitrobrew.forward_kl, reverse_kl, jsd) and top-K from hidden
states with normalize="full" (nitrobrew.topk_kl). They share the chunk loop below and differ only in how
a chunk's rows become their losses and G.

A training step needs four matrix products for a student/teacher loss: both models' logits, then
dxs = G . ws and dws = G^T . xs from G = dLoss/dz. The recompute path (the default for inference and
reduction="none") saves per-row statistics in the forward and recomputes the logits in the backward: six
products. This path walks the tokens in chunks instead. For each chunk,

    both models' products are formed once, in float32, `product_rows` rows at a time
    (fused_linear_grad_chunk), and turned into the rows' losses and G (scaled by the reduction's
    weight) by row kernels that read them twice (three times for JSD);
    dxs[chunk] = G . ws, dws += G^T . xs[chunk], dbias_s += column sums of G.

The forward then holds the whole loss's gradients; autograd's backward multiplies them by the upstream
gradient (a scalar: every reduction but "none"). What it costs, and when it runs: docs/design.md.

Memory beyond the gradients themselves: a chunk's G (`grad_rows` x V, in the inputs' dtype on CUDA, the
accumulation dtype on the CPU) and the products of `product_rows` rows (float32, float64 for float64
inputs; two models), within `grad_chunk_mib` (at least one row of each). Each chunk after the first reads
and writes dws once more, so chunks are as long as that bound allows.

The chunk loop runs in Python over the tokens' count, so torch.compile specializes a graph on it: the
automatic choice keeps to the recompute path while compiling, whose graph takes any count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from nitrobrew._reduction import reduce_rows
from nitrobrew._registration import ops, stats_dtype

# The default bound of the training path's working set (grad_chunk_mib).
DEFAULT_CHUNK_MIB = 2048
# Rows of one step of products: enough for cuBLAS to run at full rate (measured: docs/performance.md).
PRODUCT_ROWS = 512


@torch.library.register_fake("nitrobrew::products")
def _(x, w, vocab_size):
    ld = (vocab_size + 7) // 8 * 8  # rows padded to 8 entries (registration.cpp)
    return torch.empty_strided((x.shape[0], vocab_size), (ld, 1), dtype=stats_dtype(x.dtype), device=x.device)


@torch.library.register_fake("nitrobrew::product_partials")
def _(zs, zt, labels, bias_s, bias_t, row_stats, *options):
    if row_stats is not None:
        return zs.new_empty((1, zs.shape[0], 2), dtype=torch.float64)
    return zs.new_empty((1, zs.shape[0], 11))  # one part (PartialField, row_partial.h)


@torch.library.register_fake("nitrobrew::product_grads")
def _(zs, zt, labels, bias_s, bias_t, row_stats, row_scale, *options):
    n, vocab = zs.shape
    ld = (vocab + 7) // 8 * 8
    return torch.empty_strided((n, vocab), (ld, 1), dtype=grad_dtype(options[-1], zs.device.type), device=zs.device)


@torch.library.register_fake("nitrobrew::accumulate_grad")
def _(acc, g, x, beta):
    return None


@torch.library.register_fake("nitrobrew::scaled")
def _(x, factor):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("nitrobrew::fused_linear_grad_chunk")
def _(xs, xt, ws, wt, labels, bias_s, bias_t, row_scale, ignore_index, divergence, beta, temperature, ce_weight,
      softcap_s, softcap_t, logit_scale_s, logit_scale_t, vocab_size, product_rows, entropy=False):
    torch._check(xs.dim() == 2 and xt.dim() == 2 and xs.shape[0] == xt.shape[0],
                 lambda: "xs and xt must be [N, D] with the same N")
    n, ld = xs.shape[0], (vocab_size + 7) // 8 * 8  # G's rows are padded to 8 entries (registration.cpp)
    return (xs.new_empty((n,), dtype=stats_dtype(xs.dtype)),
            torch.empty_strided((n, vocab_size), (ld, 1), dtype=_grad_dtype(xs), device=xs.device),
            xs.new_empty((n if entropy else 0,), dtype=stats_dtype(xs.dtype)))


# Where the automatic choice takes the training path: the devices where it measured faster than the
# recompute path (docs/performance.md: 0.83x its step on the CPU, 0.68-0.76x on the H100).
AUTOMATIC_DEVICES = frozenset({"cpu", "cuda"})
# Where top-K's automatic choice takes its training path (normalize="full"): CUDA, where its step measured
# 0.85-0.90x the recompute path's on the H100; not the CPU, where it measured as fast as the recompute path,
# not faster (docs/performance.md).
TOPK_AUTOMATIC_DEVICES = frozenset({"cuda"})


def wanted(choice: bool | None, reduction: str, differentiable: tuple, device_type: str,
           automatic: frozenset = AUTOMATIC_DEVICES) -> bool:
    """Whether the training path runs: asked for (True), or automatic (None) on the `automatic` devices; a
    scalar loss, and autograd recording a graph for one of the differentiable inputs (None allowed)."""
    if choice is not None and not isinstance(choice, bool):
        raise TypeError(f"grad_in_forward must be None (automatic), True or False, got {choice!r}")
    if choice is False:
        return False
    if reduction == "none":
        if choice:
            raise ValueError('grad_in_forward=True needs a scalar loss (reduction "sum" or "mean"): with '
                             'reduction="none" the gradient of each token depends on its upstream gradient')
        return False
    if choice is None and (device_type not in automatic or torch.compiler.is_compiling()):
        return False
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)


# The most chunks of G over which dws is accumulated in 16 bits (CUDA, bf16 or fp16 inputs): each chunk after
# the first rounds dws once more. Simulated (bf16, docs/notes/fused_linear_training_path.md): dws's error is
# 1.22x / 1.42x / 1.57x / 2.10x that of one rounding at 2 / 3 / 4 / 8 chunks; with the recompute path's own
# error (1.4x one rounding) 4 chunks stay within ~1.3x of it (measured at 3: 1.23-1.33x). Past that (Qwen's
# vocabulary, the default bound: ~18k tokens) dws accumulates in float32 (nitrobrew::accumulate_grad) and is
# rounded once, in the backward: 2 more bytes per entry of ws, beyond grad_chunk_mib.
MAX_ROUNDED_CHUNKS = 4


def chunk_count(n: int, vocab: int, dtype: torch.dtype, device_type: str, chunk_bytes: int) -> int:
    """How many chunks of G the training path takes for n tokens."""
    return math.ceil(max(n, 1) / chunk_plan(n, vocab, dtype, device_type, chunk_bytes).grad_rows)


def _rounds_dws(dtype: torch.dtype, device_type: str) -> bool:
    """Whether G, and so a dws accumulated in G's dtype, is 16-bit there."""
    return torch.finfo(grad_dtype(dtype, device_type)).bits <= 16


def float32_dws(n: int, vocab: int, dtype: torch.dtype, device_type: str, chunk_bytes: int) -> bool:
    """Whether dws accumulates in float32 rather than in G's 16-bit dtype (see MAX_ROUNDED_CHUNKS), for n
    tokens of one rank."""
    return (_rounds_dws(dtype, device_type)
            and chunk_count(n, vocab, dtype, device_type, chunk_bytes) > MAX_ROUNDED_CHUNKS)


def chunk_budget_bytes(grad_chunk_mib) -> int:
    if grad_chunk_mib is None:
        return DEFAULT_CHUNK_MIB << 20
    if isinstance(grad_chunk_mib, bool) or not isinstance(grad_chunk_mib, int) or grad_chunk_mib < 1:
        raise ValueError(f"grad_chunk_mib must be a positive int (MiB) or None, got {grad_chunk_mib!r}")
    return grad_chunk_mib << 20


@dataclass(frozen=True)
class Chunks:
    """grad_rows: the rows of one chunk of G (dws is accumulated once per chunk); product_rows: the rows
    of one step of products inside it."""

    grad_rows: int
    product_rows: int


def plan_chunks(n: int, vocab: int, *, product_bytes: int, grad_bytes: int, budget: int) -> Chunks:
    """Chunks of n rows within `budget` bytes: product_rows x vocab x product_bytes of products and
    grad_rows x vocab x grad_bytes of G. Products take at most half of the budget; G the rest, in
    chunks of equal length (a multiple of product_rows)."""
    n = max(n, 1)
    product_rows = max(1, min(n, PRODUCT_ROWS, budget // 2 // (product_bytes * vocab)))
    rest = budget - product_rows * product_bytes * vocab
    longest = max(product_rows, rest // (grad_bytes * vocab) // product_rows * product_rows)
    chunks = math.ceil(n / longest)
    grad_rows = math.ceil(math.ceil(n / chunks) / product_rows) * product_rows
    return Chunks(min(grad_rows, n), product_rows)


def grad_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """G's dtype: the inputs' on CUDA (the tensor cores' operand), the accumulation dtype on the CPU."""
    return dtype if device_type == "cuda" else stats_dtype(dtype)


def _grad_dtype(x: Tensor) -> torch.dtype:
    return grad_dtype(x.dtype, x.device.type)


def chunk_plan(n: int, vocab: int, dtype: torch.dtype, device_type: str, chunk_bytes: int) -> Chunks:
    """The chunks the training path takes for n tokens of `dtype` inputs: a step holds two [product_rows, V]
    matrices in the accumulation dtype (both models' products, or top-K's logits and their gradient)."""
    return plan_chunks(n, vocab, product_bytes=2 * torch.finfo(stats_dtype(dtype)).bits // 8,
                       grad_bytes=torch.finfo(grad_dtype(dtype, device_type)).bits // 8, budget=chunk_bytes)


def _row_weight(n: int, reduction: str, flat_labels: Tensor | None, ignore_index: int, device, dtype) -> Tensor:
    """The reduction's weight of each unmasked row, as a scalar tensor: 1 ("sum"), 1 / unmasked rows ("mean")."""
    if reduction == "sum":
        return torch.ones((), dtype=dtype, device=device)
    if flat_labels is None:
        return torch.full((), 1.0 / max(n, 1), dtype=dtype, device=device)
    return 1.0 / (flat_labels != ignore_index).sum().clamp(min=1).to(dtype)


def _float16_range_scale(weight: Tensor) -> Tensor:
    """A power of two s with weight * s in [2^-0.5, 2^0.5]: float16's G is stored as G * weight * s, so that
    small entries keep float16's range; the backward multiplies by 1 / s, which is exact."""
    return torch.exp2(-torch.round(torch.log2(weight)))


def _scaled_gradients(ctx, grad_loss):
    """The saved (dxs, dws, dbias_s) times the upstream gradient, each in its input's dtype."""
    if torch.is_grad_enabled():
        raise RuntimeError("nitrobrew's fused losses support one backward pass; double backward "
                           "(create_graph=True) is not implemented")
    dxs, dws, dbias, unscale = ctx.saved_tensors
    xs_dtype, ws_dtype = ctx.dtypes
    # dxs and dbias_s come from G stored times float16's range scale; dws does not (see _forward_grads).
    ranged = grad_loss if unscale is None else grad_loss * unscale
    # Data parallelism: dws and dbias_s hold every rank's tokens' terms, averaged over the ranks as FSDP2
    # averages; the forward could not weight them by each rank's upstream gradient, so all must be alike.
    weight_grad = grad_loss
    if ctx.group is not None and (dws is not None or dbias is not None):  # ws's requires_grad: alike on every rank
        weight_grad = _same_on_every_rank(grad_loss, ctx.group) / ctx.world
    weight_ranged = weight_grad if unscale is None else weight_grad * unscale
    # Each gradient times its factor in float32, one rounding to its dtype (exact when the factor is
    # a power of two: loss.backward()'s 1, or a loss scale).
    return [None if t is None else ops.scaled(t, factor).to(dtype)
            for t, factor, dtype in ((dxs, ranged, xs_dtype), (dws, weight_grad, ws_dtype),
                                     (dbias, weight_ranged, ws_dtype))]


def _same_on_every_rank(grad_loss: Tensor, group) -> Tensor:
    """grad_loss, after checking that every rank of `group` has the same (one all-gather of a scalar and a
    host read: every rank raises alike)."""
    from nitrobrew import distributed

    every = distributed._all_gather(grad_loss.reshape(1), group)
    alike = (every == every[0]) | (every.isnan() & every[0].isnan())  # a NaN passes on, as on the recompute path
    if not bool(alike.all()):
        raise RuntimeError(
            "grad_in_forward=True over FSDP2's shards (each rank's own tokens) needs the same upstream gradient "
            f"on every rank: the shard's ws.grad sums every rank's tokens, formed in the forward; got "
            f"{every.flatten().tolist()}. Scale the loss alike on every rank, or pass grad_in_forward=False")
    return grad_loss


def _save(ctx, xs, ws, saved, group=None):
    ctx.save_for_backward(*saved)
    ctx.dtypes = (xs.dtype, ws.dtype)
    ctx.group = group  # data parallelism's group (the ranks whose tokens dws sums), or None
    if group is not None:
        from nitrobrew import distributed

        ctx.world = distributed._dist().get_world_size(group)


class FusedLinearForwardGrads(torch.autograd.Function):
    """The fused-linear losses on the training path: forward returns the reduced loss and holds dxs, dws,
    dbias_s; backward scales them by the upstream gradient. With `entropy` the forward also returns each
    row's student entropy (no gradient; masked rows 0), else an empty tensor."""

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, labels, bias_s, bias_t, options: tuple, reduction: str, chunk_bytes: int,
                needs: tuple, shards=None, entropy: bool = False):
        # shards: a vocabulary shard per rank (nitrobrew/_training_shards.py), whose chunks merge their rows
        # over the group; else the whole vocabulary, one op per chunk.
        entropies = []
        if shards is not None:  # data parallelism: every rank's tokens, gathered
            xs, xt, labels = shards.gather_tokens(xs, xt, labels)
            rows = shards.rows(xs, xt, ws, wt, labels, bias_s, bias_t, entropies if entropy else None)
        else:
            def grad_chunk(b0, b1, row_scale, product_rows):
                loss_b, grad_b, entropy_b = ops.fused_linear_grad_chunk(
                    xs[b0:b1], xt[b0:b1], ws, wt, None if labels is None else labels[b0:b1], bias_s, bias_t,
                    row_scale, *options, product_rows, entropy)
                entropies.append(entropy_b)
                return loss_b, grad_b

            rows = _ChunkRows(options[-1], options[-1], None, grad_chunk)
        # The products' dtypes are this path's own: torch.autocast (the caller's inputs are already cast)
        # must not round G or the hidden states again.
        with torch.autocast(xs.device.type, enabled=False):
            loss, saved = _forward_grads(xs, ws, labels, options[0], reduction, chunk_bytes, needs, rows)
        _save(ctx, xs, ws, saved, None if rows.owners is None else shards.shard.group)
        row_entropy = loss.new_empty((0,))
        if entropy and entropies:
            own = _owner_spans(xs.shape[0], rows.owners)[1]  # data parallelism: this rank's tokens'
            row_entropy = torch.cat(entropies)[own[0]:own[1]].clone()  # not a view of every rank's tokens
        ctx.mark_non_differentiable(row_entropy)
        return loss, row_entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy):
        dxs, dws, dbias = _scaled_gradients(ctx, grad_loss)
        return dxs, None, dws, None, None, dbias, None, None, None, None, None, None, None


class TopKForwardGrads(torch.autograd.Function):
    """Top-K from hidden states (normalize="full") on the training path, as FusedLinearForwardGrads. A
    step's rows: the student's float32 products (nitrobrew::products), its lm_head bias and logit scale,
    then the logits family's top-K forward and backward (nitrobrew.logits.topk_kl's kernels) for their
    losses and G; over vocabulary shards (shards: _training_shards.TopKTrainingShards) the shards' row
    states merged between the two."""

    @staticmethod
    def forward(ctx, xs, ws, teacher_ids, teacher_logprobs, labels, bias_s, options: tuple, reduction: str,
                chunk_bytes: int, needs: tuple, shards=None):
        ignore_index, temperature, logit_scale_s = options
        if shards is not None:  # data parallelism: every rank's tokens, gathered
            xs, teacher_ids, teacher_logprobs, labels = shards.gather_tokens(xs, teacher_ids, teacher_logprobs,
                                                                             labels)
        vocab = ws.shape[0]
        bias = None if bias_s is None else bias_s.to(stats_dtype(xs.dtype))
        step_rows = topk_step_rows if shards is None else shards.step_rows(teacher_ids, teacher_logprobs)

        def grad_chunk(b0, b1, row_scale, product_rows):
            n = b1 - b0
            loss = xs.new_empty((n,), dtype=stats_dtype(xs.dtype))
            ld = (vocab + 7) // 8 * 8  # as the fused-linear op's G
            grad = torch.empty((n, ld), dtype=_grad_dtype(xs), device=xs.device)[:, :vocab]
            for r0 in range(b0, b1, product_rows):
                r1 = min(b1, r0 + product_rows)
                z = ops.products(xs[r0:r1], ws, vocab)
                if bias is not None:
                    z.add_(bias)
                if logit_scale_s != 1.0:
                    z.mul_(logit_scale_s)
                loss_r, dz = step_rows(z, teacher_ids[r0:r1], teacher_logprobs[r0:r1],
                                       None if labels is None else labels[r0:r1], row_scale, r0, r1,
                                       (ignore_index, temperature, False, "forward_kl", 0.0))
                if logit_scale_s != 1.0:  # G is dLoss/d(products + bias), as the fused-linear op's
                    dz.mul_(logit_scale_s)
                loss[r0 - b0:r1 - b0] = loss_r
                grad[r0 - b0:r1 - b0] = dz
            return loss, grad

        if shards is None:
            rows = _ChunkRows(vocab, vocab, None, grad_chunk)
        else:
            rows = _ChunkRows(vocab, shards.plan_vocab, shards.sum_dxs, grad_chunk, shards.owners)
        with torch.autocast(xs.device.type, enabled=False):
            loss, saved = _forward_grads(xs, ws, labels, ignore_index, reduction, chunk_bytes, needs, rows)
        _save(ctx, xs, ws, saved, None if rows.owners is None else shards.group)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        dxs, dws, dbias = _scaled_gradients(ctx, grad_loss)
        return dxs, dws, None, None, None, dbias, None, None, None, None, None


def topk_step_rows(z, ids, logprobs, labels, row_scale, r0, r1, options):
    """A step's top-K losses and dLoss/dz (times row_scale) from its logits z over the whole vocabulary."""
    loss, stats = ops.topk_logits_fwd(z, ids, logprobs, labels, *options)
    return loss, ops.topk_logits_bwd(row_scale.expand(z.shape[0]).contiguous(), z, ids, logprobs, labels, stats,
                                     *options)


@dataclass(frozen=True)
class _ChunkRows:
    """What the chunk loop needs of a loss: grad_chunk(b0, b1, row_scale, product_rows) returns the losses
    of rows [b0, b1) and their G over the first `vocab` rows of ws (times row_scale, in _grad_dtype), from
    products of product_rows rows at a time; plan_vocab: the columns the chunks are planned for (alike on
    every rank of a vocabulary-sharded loss); sum_dxs: dxs's terms summed over the shards (the tensor it
    returns: all of dxs, or in data parallelism this rank's own rows), or None; owners: in data
    parallelism, every rank's token count (the rows are every rank's tokens, in rank order) and this
    rank's place, else None."""

    vocab: int
    plan_vocab: int
    sum_dxs: object
    grad_chunk: object
    owners: tuple[tuple[int, ...], int] | None = None


def _owner_spans(n: int, owners) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """The rows of each rank's tokens, and this rank's: [(0, n)] and (0, n) without data parallelism."""
    if owners is None:
        return [(0, n)], (0, n)
    counts, rank = owners
    starts = [sum(counts[:r]) for r in range(len(counts) + 1)]
    spans = list(zip(starts[:-1], starts[1:]))
    return spans, spans[rank]


def _forward_grads(xs, ws, labels, ignore_index, reduction, chunk_bytes, needs, rows: _ChunkRows):
    """The chunk loop over `rows` (_ChunkRows). Returns the reduced loss and what the backward scales:
    (dxs, dws, dbias_s, float16's unscale or None). In data parallelism (rows.owners) each rank's tokens
    are reduced alone: chunks do not cross ranks' tokens, each weighted by its rank's reduction, and the loss
    and dxs are this rank's tokens'."""
    need_dxs, need_dws, need_dbias = needs
    n, vocab = xs.shape[0], rows.vocab
    gdtype = _grad_dtype(xs)
    loss_dtype = stats_dtype(xs.dtype)
    chunks = chunk_plan(n, rows.plan_vocab, xs.dtype, xs.device.type, chunk_bytes)
    spans, own = _owner_spans(n, rows.owners)
    weights = [_row_weight(s1 - s0, reduction, None if labels is None else labels[s0:s1], ignore_index, xs.device,
                           loss_dtype) for s0, s1 in spans]
    # float16: G is stored times `range_scale`. The backward takes it out of dxs and dbias_s; dws, a sum
    # over every token that could leave float16's range at that scale, takes it out at once through the
    # hidden states, as the recompute path's g * xs does (a power of two: exact unless subnormal). Set by
    # the largest weight of the ranks' spans that hold an unmasked row (the others add nothing to G).
    range_scale = None
    if gdtype == torch.float16:
        live = torch.stack([(labels[s0:s1] != ignore_index).any() if labels is not None
                            else torch.tensor(s1 > s0, device=xs.device) for s0, s1 in spans])
        largest = torch.where(live, torch.stack(weights), 0).max()
        range_scale = _float16_range_scale(torch.where(largest > 0, largest, 1))
    unscale = None if range_scale is None else 1.0 / range_scale
    # The chunks: none crosses a rank's tokens (data parallelism). No token: one empty chunk, zero gradients;
    # a rank without tokens adds no chunk.
    bounds = [(b0, min(s1, b0 + chunks.grad_rows), weight) for (s0, s1), weight in zip(spans, weights)
              for b0 in range(s0, s1, chunks.grad_rows)] or [(0, 0, weights[0])]
    losses = []
    dxs = dws = dws_v = dbias = ws_v = None
    if need_dxs:
        ws_v = ws[:vocab] if gdtype == ws.dtype else ws[:vocab].to(gdtype)
        dxs = xs.new_empty((n, xs.shape[1]), dtype=gdtype)
    # dws in G's dtype, or where 16-bit dws would be rounded in more than MAX_ROUNDED_CHUNKS chunks, in float32
    # (the chunks are alike on every rank of a sharded loss, and so is this choice).
    wide_dws = need_dws and _rounds_dws(xs.dtype, xs.device.type) and len(bounds) > MAX_ROUNDED_CHUNKS
    if need_dws:
        dws = ws.new_empty(ws.shape, dtype=torch.float32 if wide_dws else gdtype)
        dws[vocab:].zero_()  # padded rows past vocab_size get no gradient
        dws_v = dws[:vocab]
    if need_dbias:
        dbias = torch.zeros(ws.shape[0], dtype=loss_dtype, device=ws.device)
    for b0, b1, weight in bounds:
        first = b0 == bounds[0][0]
        xs_b = xs[b0:b1]
        row_scale = weight if range_scale is None else weight * range_scale
        loss_b, grad_b = rows.grad_chunk(b0, b1, row_scale, chunks.product_rows)
        losses.append(loss_b)
        if need_dxs:
            torch.mm(grad_b, ws_v, out=dxs[b0:b1])
        if need_dws:  # the first chunk writes dws (beta 0 ignores what the buffer held), the rest add to it
            if wide_dws:  # float16's range scale comes out of the float32 sum below, not out of x
                ops.accumulate_grad(dws_v, grad_b, xs_b.to(gdtype).contiguous(), 0.0 if first else 1.0)
            else:
                x = xs_b.to(gdtype) if unscale is None else ops.scaled(xs_b, unscale)
                dws_v.addmm_(grad_b.t(), x, beta=0 if first else 1)
        if need_dbias:
            dbias[:vocab] += grad_b.sum(0, dtype=loss_dtype)
        del grad_b
    if wide_dws and unscale is not None:
        dws_v.mul_(unscale)  # a power of two, exact in float32
    if need_dxs and rows.sum_dxs is not None:
        dxs = rows.sum_dxs(dxs)
    losses = torch.cat(losses) if len(losses) > 1 else losses[0]
    o0, o1 = own
    loss = reduce_rows(losses[o0:o1], (o1 - o0,), reduction, None if labels is None else labels[o0:o1], ignore_index)
    # In G's dtype: the backward's product with the upstream gradient is their only rounding to the inputs'
    # dtype on the CPU; on CUDA, they are the inputs' dtype already (exact when that gradient is 1).
    return loss, (dxs, dws, dbias, unscale)
