"""The training path (_forward_grads.py) over vocabulary shards: process_group= or DTensor lm_heads whose
ranks hold the same tokens (tensor parallelism), or each its own (FSDP2's data parallelism).

Each rank forms its shard's products of a step of rows once (nitrobrew::products), folds them into the
rows' unfinished states (nitrobrew::product_partials), which one all-gather and merge_shards finish over
the whole vocabulary, alike on every rank (JSD: a second all-gather of the mixture sums), then writes
its shard's G from the merged statistics (nitrobrew::product_grads). The chunk loop forms dws and dbias_s
of the shard's rows from G, and dxs's shard term, which one all-reduce sums at the end of the forward:
the collectives of the recompute path (docs/distributed.md), with the backward's all-reduce moved into
the forward. Every rank plans its chunks for the largest shard, so that all run the same steps and
collectives.

In data parallelism the ranks' tokens are all-gathered first (as the recompute path does), each rank's
tokens are weighted by its own reduction, dxs's sum is a reduce-scatter to each rank's own tokens, and the
backward averages dws over the ranks as FSDP2 does, which needs the same upstream gradient on every rank
(checked there: _forward_grads._same_on_every_rank).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nitrobrew import _checks, distributed
from nitrobrew._forward_grads import _ChunkRows, _grad_dtype
from nitrobrew._registration import ops, stats_dtype

# The devices with the product ops (nitrobrew::product_partials, product_grads).
DEVICES = frozenset({"cpu", "cuda"})


class TrainingShards:
    """A vocabulary-sharded loss's rows for the chunk loop (FusedLinearForwardGrads' `shards`)."""

    def __init__(self, call: distributed.FusedLinearCall, shard, vocab_size: int, tokens_per_rank, needs_dxs: bool):
        self.call, self.shard, self.vocab_size = call, shard, vocab_size
        self.tokens_per_rank = tokens_per_rank  # data parallelism: every rank's token count, else None
        self.needs_dxs = needs_dxs  # whether dxs is formed (alike on every rank: its sum is a collective)
        self.real = max(0, min(vocab_size - shard.start, shard.rows))  # the shard's rows inside vocab_size
        self.options = call.op_options(self.real)[:-2]  # the product ops' (no vocab_size, chunk_v)

    def gather_tokens(self, xs, xt, labels):
        """Every rank's tokens in rank order (data parallelism), else the inputs as they are; labels checked
        where the cross-entropy reads them, on inputs every rank holds alike, so that every rank raises alike."""
        if self.tokens_per_rank is not None:
            xs, xt, labels = (None if t is None else distributed._gather_tokens(t, self.tokens_per_rank,
                                                                                self.shard.group)
                              for t in (xs, xt, labels))
        if self.call.ce_weight > 0:  # the cross-entropy reads the student's logit at each label
            _checks.ids_in_range(labels, self.vocab_size, "labels", self.call.ignore_index)
        return xs, xt, labels

    def rows(self, xs, xt, ws, wt, labels, bias_s, bias_t, entropies: list | None = None) -> _ChunkRows:
        """The chunk loop's rows; with `entropies` (call.entropy) each step's student entropies appended to it,
        in row order."""
        call, shard, real = self.call, self.shard, self.real
        local = distributed._local_labels(labels, shard, real, call.ignore_index)
        gdtype = _grad_dtype(xs)
        biases = tuple(None if b is None else b.contiguous() for b in (bias_s, bias_t))  # as the CUDA ops take them
        ld = (real + 7) // 8 * 8  # G's rows padded to 8 entries, as the op's

        def step(r0, r1, row_scale):
            """(loss, G) of rows [r0, r1): their products formed once, their states merged over the group."""
            lab = None if labels is None else labels[r0:r1]
            loc = None if local is None else local[r0:r1]
            if real == 0:  # a shard wholly in the padding (or of no rows) holds nothing
                part = distributed._empty_partials(xs[r0:r1]).unsqueeze(0)  # one part, as the op's
                loss, row_stats = distributed._merged_rows(
                    part, lambda _: xs.new_zeros((1, r1 - r0, 2), dtype=torch.float64), lab, call, self.vocab_size,
                    shard.group)
                grad = xs.new_empty((r1 - r0, 0), dtype=gdtype)
            else:
                zs, zt = ops.products(xs[r0:r1], ws, real), ops.products(xt[r0:r1], wt, real)
                shard_rows = (zs, zt, loc, biases[0], biases[1])
                loss, row_stats = distributed._merged_rows(
                    ops.product_partials(*shard_rows, None, *self.options, xs.dtype, call.entropy),
                    lambda stats: ops.product_partials(*shard_rows, stats, *self.options, xs.dtype), lab, call,
                    self.vocab_size, shard.group)
                grad = ops.product_grads(*shard_rows, row_stats, row_scale, *self.options, xs.dtype)
            if entropies is not None:
                entropies.append(distributed.entropy_of(row_stats))
            return loss, grad

        def grad_chunk(b0, b1, row_scale, product_rows):
            loss = xs.new_empty((b1 - b0,), dtype=stats_dtype(xs.dtype))
            grad = torch.empty((b1 - b0, ld), dtype=gdtype, device=xs.device)[:, :real]
            for r0 in range(b0, b1, product_rows):
                r1 = min(b1, r0 + product_rows)
                loss[r0 - b0:r1 - b0], grad[r0 - b0:r1 - b0] = step(r0, r1, row_scale)
            return loss, grad

        def sum_dxs(dxs):  # all of dxs, or this rank's own tokens' rows (a reduce-scatter)
            return distributed._sum_tokens(dxs, self.tokens_per_rank, shard.group)

        owners = None if self.tokens_per_rank is None else (
            self.tokens_per_rank, distributed._dist().get_rank(shard.group))
        return _ChunkRows(real, min(shard.max_rows, self.vocab_size), sum_dxs, grad_chunk, owners)


class TopKTrainingShards:
    """A vocabulary-sharded top-K loss (normalize="full") for TopKForwardGrads: each step's shard logits run
    the top-K forward with the teacher ids the shard holds (distributed._TopKShard's layout), the shards'
    states are merged over the group (one all-gather of [n, 2 + K] float64), then the top-K backward."""

    def __init__(self, call: distributed.TopKCall, shard, tokens_per_rank=None):
        self.topk = distributed._TopKShard(call, shard)
        self.group, self.tokens_per_rank = shard.group, tokens_per_rank
        self.plan_vocab = shard.max_rows  # chunks planned for the largest shard: every rank runs alike
        self.owners = None if tokens_per_rank is None else (tokens_per_rank, distributed._dist().get_rank(shard.group))

    def gather_tokens(self, xs, ids, logprobs, labels):
        """Every rank's tokens in rank order (data parallelism), else the inputs as they are."""
        if self.tokens_per_rank is None:
            return xs, ids, logprobs, labels
        return tuple(None if t is None else distributed._gather_tokens(t, self.tokens_per_rank, self.group)
                     for t in (xs, ids, logprobs, labels))

    def step_rows(self, ids, logprobs):
        """TopKForwardGrads' step over this shard (the ids' range checked on ids every rank holds alike)."""
        held, local_ids, local_logprobs = self.topk._local_teacher(ids, logprobs)

        def step(z, ids_r, logprobs_r, labels_r, row_scale, r0, r1, options):
            local = (local_ids[r0:r1], local_logprobs[r0:r1], labels_r)
            local_stats = ops.topk_logits_fwd(z, *local, *options)[1] if z.shape[1] > 0 else None
            loss, row_stats = self.topk._merged(local_stats, held[r0:r1], logprobs_r, labels_r,
                                                z.dtype == torch.float64)
            if z.shape[1] == 0:  # a shard of no rows: no G
                return loss, z
            return loss, ops.topk_logits_bwd(row_scale.expand(z.shape[0]).contiguous(), z, *local, row_stats,
                                             *options)

        return step

    def sum_dxs(self, dxs):  # all of dxs, or this rank's own tokens' rows (a reduce-scatter)
        return distributed._sum_tokens(dxs, self.tokens_per_rank, self.group)


@torch.compiler.disable  # collectives and host reads of the layout: run eagerly (a graph break)
def topk_loss(xs: Tensor, ws: Tensor, bias_s, teacher_ids: Tensor, teacher_logprobs: Tensor, labels,
              call: distributed.TopKCall, group, tokens_sharded: bool, reduction: str, chunk_bytes: int) -> Tensor:
    """The reduced top-K loss (normalize="full") of 2-D inputs over the vocabulary shards ws of `group`'s ranks,
    its gradients formed in the forward."""
    from nitrobrew._forward_grads import TopKForwardGrads

    shard = distributed._shard_layout(ws.shape[0], ws.shape[0], xs.device, group)
    tokens_per_rank, needs_dxs = _token_layout(xs, group, tokens_sharded)
    needs = (needs_dxs, ws.requires_grad, bias_s is not None and bias_s.requires_grad)
    return TopKForwardGrads.apply(xs, ws, teacher_ids, teacher_logprobs, labels, bias_s,
                                  (call.ignore_index, call.temperature, call.logit_scale_s), reduction, chunk_bytes,
                                  needs, TopKTrainingShards(call, shard, tokens_per_rank))


def _token_layout(xs: Tensor, group, tokens_sharded: bool) -> tuple[tuple | None, bool]:
    """(every rank's token count, whether dxs is formed) in data parallelism (distributed.token_layout);
    (None, xs.requires_grad) in tensor parallelism, whose xs is the same on every rank."""
    return distributed.token_layout(xs, group) if tokens_sharded else (None, xs.requires_grad)


def plan(call: distributed.FusedLinearCall, shard, xs: Tensor, tokens_sharded: bool) -> TrainingShards:
    """The training path's shards: chunks planned for the largest shard, so that every rank runs alike; in
    data parallelism (tokens_sharded) every rank's token count."""
    tokens_per_rank, needs_dxs = _token_layout(xs, shard.group, tokens_sharded)
    vocab_size = shard.total if call.vocab_size is None else call.vocab_size
    return TrainingShards(call, shard, vocab_size, tokens_per_rank, needs_dxs)


def runs_on(device_type: str) -> bool:
    """Whether the sharded training path runs there: the product ops' devices."""
    return device_type in DEVICES


def loss(xs: Tensor, xt: Tensor, ws: Tensor, wt: Tensor, labels, bias_s, bias_t, options: tuple, reduction: str,
         chunk_bytes: int, shards: TrainingShards) -> tuple[Tensor, Tensor]:
    """The reduced loss on the training path over shards, its gradients formed in the forward, and with
    shards.call.entropy this rank's tokens' student entropies (else an empty tensor)."""
    from nitrobrew._forward_grads import FusedLinearForwardGrads

    needs = (shards.needs_dxs, ws.requires_grad, bias_s is not None and bias_s.requires_grad)
    return FusedLinearForwardGrads.apply(xs, xt, ws, wt, labels, bias_s, bias_t, options, reduction, chunk_bytes,
                                         needs, shards, shards.call.entropy)
