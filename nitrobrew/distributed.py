"""Vocabulary-parallel losses over torch.distributed, and lm_head weights sharded as DTensors.

`process_group=` on forward_kl / reverse_kl / jsd (from hidden states and from logits) runs the loss
over a vocabulary split across the group's ranks:

  - each rank holds a contiguous shard of the vocabulary, in rank order: rows of ws and wt (both
    models' shards cover the same entries, so on each rank ws and wt have the same row count), or
    columns of the logits; shards may differ in size, and a shard may lie wholly in the padding past
    vocab_size (which is the whole vocabulary's);
  - xs, xt, labels and the options are the same on every rank, and every rank returns the loss over
    the whole vocabulary;
  - gradients: xs.grad is the whole gradient on every rank; ws.grad and bias_s.grad (zs.grad) are
    those of the rank's shard.

What is exchanged is per-row statistics, never weights or logits (docs/distributed.md): the forward
all-gathers the shards' unfinished row states (11 floats per token; JSD a second time, 2 float64 per
token), the backward all-reduces the hidden states' gradient [N, D_s] (none for logits). The shards
merge exactly as a single device's vocabulary splits do (the same C++ merge), so every rank finishes
identical rows.

DTensor weights (ws, wt sharded on dim 0 over a 1-D mesh: tensor parallelism's ColwiseParallel
lm_head, or an FSDP2 fully_shard-ed lm_head read outside its forward) need no process_group:

  - xs a DTensor replicated over the mesh (tensor parallelism): the path above, over the mesh's group;
  - xs a plain tensor (data parallelism, FSDP2): every rank's tokens differ. Instead of gathering the
    weights, the ranks all-gather the hidden states and labels, each computes its vocabulary shard for
    every rank's tokens, and each rank gets its own tokens' losses back. ws.grad (bias_s.grad) is the
    gradient FSDP2 would reduce-scatter: the ranks' gradients averaged (FSDP2's default division by
    the world size); xs.grad is the rank's own tokens' gradient (a reduce-scatter of the shards' terms).

A whole (Replicate) DTensor weight is used as it is; other layouts (Shard(1), Partial, meshes of
several dimensions) raise. torch.distributed is imported only when these paths run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from nitrobrew import _checks
from nitrobrew._divergences import runs_second_pass
from nitrobrew._registration import ops, save_tensors, saved_tensors, stats_dtype

# Columns of a shard's unfinished row states (PartialField in csrc/divergence/row_partial.h).
NUM_PARTIAL_FIELDS = 11
# Columns of the top-K row statistics before the K logits (TopKRowStat in csrc/divergence/topk_params.h).
NUM_TOPK_ROW_STATS = 5

__all__ = ["FusedLinearCall", "TopKCall", "fused_linear_loss", "logits_loss", "sharded_weights", "topk_logits_loss",
           "topk_loss"]

# The unfinished row state of a shard holding none of the vocabulary (PartialField, row_partial.h):
# both softmax sides, the CE state and the entropy state empty (max -inf, sums 0), no label logit.
_EMPTY_PARTIAL = (float("-inf"), 0.0, float("-inf"), 0.0, 0.0, float("-inf"), 0.0, 0.0, float("-inf"), 0.0, 0.0)


def _fake_shard(x, row_stats):
    """A shard op's output: unfinished row states, or with row_stats JSD's mixture sums (float64)."""
    if row_stats is not None:
        return x.new_empty((x.shape[0], 2), dtype=torch.float64)
    return x.new_empty((x.shape[0], NUM_PARTIAL_FIELDS), dtype=stats_dtype(x.dtype))


@torch.library.register_fake("nitrobrew::fused_linear_shard")
def _(xs, xt, ws, wt, labels, bias_s, bias_t, row_stats, *options):
    return _fake_shard(xs, row_stats)


@torch.library.register_fake("nitrobrew::logits_shard")
def _(zs, zt, labels, row_stats, *options):
    return _fake_shard(zs, row_stats)


@torch.library.register_fake("nitrobrew::merge_shards")
def _(partials, mixture, labels, *options):
    from nitrobrew.fused_linear import NUM_ROW_STATS  # fused_linear imports this module

    rows = partials.shape[1]
    return partials.new_empty((rows,)), partials.new_empty((rows, NUM_ROW_STATS))


@torch.library.register_fake("nitrobrew::topk_merge_shards")
def _(partials, teacher_logprobs, labels, ignore_index, temperature, renormalize, divergence, beta, float64_logits):
    rows, columns = partials.shape[1], partials.shape[2]
    loss_dtype = torch.float64 if float64_logits else torch.float32
    return (partials.new_empty((rows,), dtype=loss_dtype),
            partials.new_empty((rows, NUM_TOPK_ROW_STATS + columns - 2), dtype=torch.float64))


def _dist():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group= needs an initialized torch.distributed (torch.distributed.init_process_group)")
    return dist


def _all_gather(t: Tensor, group) -> Tensor:
    """[R, *t.shape]: every rank's t, in rank order, gathered into one buffer."""
    dist = _dist()
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name since torch 2.13
    gather(out, t, group=group)
    return out.view(world, *t.shape)


def _reduce_scatter(out: Tensor, d: Tensor, group) -> None:
    dist = _dist()
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, d, group=group)


@dataclass(frozen=True)
class _Shard:
    """This rank's rows [start, start + rows) of a vocabulary of `total` rows, over `group`."""

    group: object
    start: int
    rows: int
    total: int
    world: int
    rank: int
    max_rows: int  # the largest shard's rows: what every rank plans its chunks for, alike


def _shard_layout(rows_s: int, rows_t: int, device: torch.device, group, entropy: bool = False) -> _Shard:
    """Where each rank's shard starts: one all-gather of the ranks' row counts (and of whether each asks for the
    student's entropy, which every rank's shard must form for any rank to get it)."""
    dist = _dist()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup (e.g. torch.distributed.group.WORLD "
                        f"or one from new_group), got {type(group).__name__}")
    layout = _all_gather(torch.tensor([rows_s, rows_t, int(entropy)], dtype=torch.int64, device=device), group)
    counts, asks = layout[:, :2].tolist(), layout[:, 2].tolist()
    if len(set(asks)) > 1:
        raise ValueError(
            f"return_entropy must be the same on every rank of the group: each rank's vocabulary shard adds its "
            f"part of every token's entropy, so a rank that does not ask leaves the others' wrong (ranks "
            f"{[r for r, a in enumerate(asks) if a]} asked, the others did not). Pass return_entropy=True on every "
            f"rank and use it where you need it")
    mismatched = [r for r, (s, t) in enumerate(counts) if s != t]
    if mismatched:
        raise ValueError(
            f"ws and wt must hold the same vocabulary rows on every rank (pad the smaller lm_head to the larger "
            f"one's rows before sharding and pass vocab_size); rank {mismatched[0]} holds {counts[mismatched[0]][0]} "
            f"rows of ws and {counts[mismatched[0]][1]} of wt"
        )
    rank = dist.get_rank(group)
    start = sum(c[0] for c in counts[:rank])
    return _Shard(group, start, rows_s, sum(c[0] for c in counts), len(counts), rank, max(c[0] for c in counts))


def _local_labels(labels: Tensor | None, shard: _Shard, real: int, ignore_index: int) -> Tensor | None:
    """labels in the shard's own rows; a label another shard holds becomes a negative value other than
    ignore_index, which no column holds (the shard ops take it as held elsewhere)."""
    if labels is None:
        return None
    elsewhere = -1 if ignore_index != -1 else -2
    local = labels - shard.start
    local = torch.where((local >= 0) & (local < real), local, torch.full_like(local, elsewhere))
    return torch.where(labels == ignore_index, labels, local)


@dataclass(frozen=True)
class FusedLinearCall:
    """A divergence loss's options, as fused_linear.py / logits.py validated them (vocab_size: the whole
    vocabulary's, None for every row)."""

    divergence: str
    beta: float
    temperature: float
    ce_weight: float = 0.0
    softcap_s: float | None = None
    softcap_t: float | None = None
    logit_scale_s: float = 1.0
    logit_scale_t: float = 1.0
    ignore_index: int = -100
    vocab_size: int | None = None
    chunk_v: int = 0
    entropy: bool = False  # also each row's student entropy (the fused-linear losses' return_entropy)

    def uses_mixture(self) -> bool:
        """Whether the loss needs the second pass (_divergences.runs_second_pass): its sums all-gathered too."""
        return runs_second_pass(self.divergence, self.beta)

    def op_options(self, real: int) -> tuple:
        return (self.ignore_index, self.divergence, self.beta, self.temperature, self.ce_weight, self.softcap_s,
                self.softcap_t, self.logit_scale_s, self.logit_scale_t, real, self.chunk_v)


@dataclass(frozen=True)
class TopKCall:
    """topk_kl's options, as topk_linear.py validated them (weight: the ops' beta argument, JSD's beta or the
    skew KLs' alpha)."""

    temperature: float
    renormalize: bool
    ignore_index: int
    logit_scale_s: float
    chunk_v: int
    divergence: str = "forward_kl"
    weight: float = 0.0


def _merged_rows(part: Tensor, mixture_of, labels, call: FusedLinearCall, vocab_size: int, group):
    """The shards' row states all-gathered and merged into (loss, row_stats) over the whole vocabulary;
    JSD's mixture sums (mixture_of(row_stats) -> [N, 2] of this shard) in a second round."""
    parts = _all_gather_parts(part, group)
    merge_options = (labels, call.ignore_index, call.divergence, call.beta, call.ce_weight, vocab_size)
    loss, row_stats = ops.merge_shards(parts, None, *merge_options)
    if call.uses_mixture():
        loss, row_stats = ops.merge_shards(parts, _all_gather_parts(mixture_of(row_stats), group), *merge_options)
    return loss, row_stats


def entropy_of(row_stats: Tensor) -> Tensor:
    """Each row's student entropy from merge_shards' row statistics (a copy: the backward reads them)."""
    from nitrobrew.fused_linear import ENTROPY_COLUMN  # fused_linear imports this module

    return row_stats[:, ENTROPY_COLUMN].clone()


def _all_gather_parts(part: Tensor, group) -> Tensor:
    """[N, F] (one part) or [S, N, F] (S column parts, in order, alike on every rank) of each rank, as
    [R * S, N, F] in rank order: what merge_shards merges."""
    parts = _all_gather(part, group)
    return parts.flatten(0, 1) if part.dim() == 3 else parts


class _ShardLoss:
    """What a loss family computes on its vocabulary shard, for _VocabParallel.

    Its inputs are a tuple of tensors (None allowed); token_inputs are those indexed by token (gathered
    from every rank in data parallelism), summed_grads those whose gradient is the shards' partial sum
    (the hidden states': summed over the group), shard_grads those whose gradient is this shard's own
    (weights, biases, logits)."""

    token_inputs: tuple = ()
    summed_grads: tuple = ()
    shard_grads: tuple = ()
    # Data parallelism: whether any rank needs the summed gradients (each rank then forms its terms).
    summed_anywhere: bool = False
    # Set by forward where the loss forms it: each token's student entropy [N] over the whole vocabulary.
    row_entropy: Tensor | None = None

    def forward(self, inputs: tuple) -> tuple[Tensor, tuple]:
        """(the loss [N] of every token, the tensors backward needs). Checks that depend on the inputs'
        values run here, on inputs every rank holds alike, so that every rank raises alike."""
        raise NotImplementedError

    def backward(self, saved: tuple, grad_loss: Tensor, needs: tuple) -> tuple:
        """A gradient (or None) per input, this shard's terms only."""
        raise NotImplementedError


class _VocabParallel(torch.autograd.Function):
    """A loss over the vocabulary shards of `group`'s ranks (one _ShardLoss per call).

    tokens_per_rank None: the token inputs are the same on every rank (tensor parallelism), every rank
    returns every token's loss and the hidden states' whole gradient. Otherwise each rank holds its own
    tokens (data parallelism; tokens_per_rank: every rank's count): they are all-gathered, each rank
    gets its own tokens' losses and gradient back (a reduce-scatter), and the shard's weight gradients
    are the ranks' average, as FSDP2 reduce-scatters them. Every rank must run the forward and the
    backward: both hold collectives. Returns (loss, the student's entropy per token where the shard loss
    formed it, else an empty tensor; no gradient)."""

    @staticmethod
    def forward(ctx, shard_loss: _ShardLoss, group, tokens_per_rank, *inputs):
        if tokens_per_rank is not None:
            inputs = tuple(_gather_tokens(t, tokens_per_rank, group) if i in shard_loss.token_inputs and t is not None
                           else t for i, t in enumerate(inputs))
        loss, saved = shard_loss.forward(inputs)
        entropy = shard_loss.row_entropy if shard_loss.row_entropy is not None else loss.new_empty((0,))
        shard_loss.row_entropy = None  # the ctx keeps shard_loss until the backward: not this tensor
        save_tensors(ctx, saved)
        ctx.shard_loss, ctx.group, ctx.tokens_per_rank = shard_loss, group, tokens_per_rank
        if tokens_per_rank is not None:
            rank = _dist().get_rank(group)
            begin = sum(tokens_per_rank[:rank])
            loss = loss[begin: begin + tokens_per_rank[rank]]
            entropy = entropy[begin: begin + tokens_per_rank[rank]].clone() if entropy.numel() else entropy
        ctx.mark_non_differentiable(entropy)
        return loss, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy):
        shard_loss, group, tokens_per_rank = ctx.shard_loss, ctx.group, ctx.tokens_per_rank
        if tokens_per_rank is not None:  # every rank's tokens' upstream gradients
            grad_loss = _gather_tokens(grad_loss, tokens_per_rank, group)
        needs = ctx.needs_input_grad[3:]
        # The summed gradients wherever any rank needs them: their sum is a collective every rank joins.
        forms = tuple(need or (i in shard_loss.summed_grads and shard_loss.summed_anywhere)
                      for i, need in enumerate(needs))
        grads = list(shard_loss.backward(saved_tensors(ctx), grad_loss.contiguous(), forms))
        for i in shard_loss.summed_grads:
            if forms[i]:
                grads[i] = _sum_tokens(grads[i], tokens_per_rank, group)
        if tokens_per_rank is not None:
            world = _dist().get_world_size(group)
            for i in shard_loss.shard_grads:
                grads[i] = grads[i] / world if needs[i] and grads[i] is not None else grads[i]
        return (None, None, None, *(g if need else None for g, need in zip(grads, needs)))


def _gather_tokens(t: Tensor, tokens_per_rank, group) -> Tensor:
    """Every rank's rows of t ([tokens_per_rank[rank], ...]) concatenated in rank order: the gathered
    buffer itself where every rank holds as many tokens, else padded and compacted."""
    longest = max(tokens_per_rank)
    if min(tokens_per_rank) == longest:
        return _all_gather(t, group).flatten(0, 1)
    padded = t.new_zeros((longest, *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = _all_gather(padded, group)
    return torch.cat([parts[r, :count] for r, count in enumerate(tokens_per_rank)])


def _sum_tokens(d: Tensor, tokens_per_rank, group) -> Tensor:
    """The shards' terms of d summed: all of d on every rank (tokens_per_rank None), or this rank's
    own tokens' rows (a reduce-scatter; padded where the ranks' token counts differ)."""
    if tokens_per_rank is None:
        _dist().all_reduce(d, group=group)
        return d
    longest = max(tokens_per_rank)
    if min(tokens_per_rank) < longest:
        padded = d.new_zeros((len(tokens_per_rank), longest, *d.shape[1:]))
        begin = 0
        for r, count in enumerate(tokens_per_rank):
            padded[r, :count] = d[begin: begin + count]
            begin += count
        d = padded.flatten(0, 1)
    out = d.new_empty((longest, *d.shape[1:]))
    _reduce_scatter(out, d.contiguous(), group)
    return out[: tokens_per_rank[_dist().get_rank(group)]]


def token_layout(xs: Tensor, group) -> tuple[tuple, bool]:
    """Data parallelism: every rank's token count, and whether any rank's xs needs its gradient (then every
    rank forms its terms, whose sum is a collective all must join); one all-gather and a host read."""
    mine = torch.tensor([xs.shape[0], int(xs.requires_grad)], dtype=torch.int64, device=xs.device)
    every = _all_gather(mine, group).reshape(-1, 2).tolist()
    return tuple(count for count, _ in every), any(need for _, need in every)


def _empty_partials(x: Tensor) -> Tensor:
    """The unfinished row states of a shard that holds no vocabulary entry."""
    empty = torch.tensor(_EMPTY_PARTIAL, dtype=stats_dtype(x.dtype), device=x.device)
    return empty.expand(x.shape[0], NUM_PARTIAL_FIELDS).contiguous()


class _FusedLinearShard(_ShardLoss):
    """inputs: (xs, xt, ws, wt, bias_s, bias_t, labels); ws, wt, the biases: this shard's rows."""

    token_inputs, summed_grads, shard_grads = (0, 1, 6), (0,), (2, 4)

    def __init__(self, call: FusedLinearCall, shard: _Shard):
        self.call, self.shard = call, shard
        self.vocab_size = shard.total if call.vocab_size is None else call.vocab_size
        self.real = max(0, min(self.vocab_size - shard.start, shard.rows))  # the shard's rows inside vocab_size

    def forward(self, inputs):
        xs, xt, ws, wt, bias_s, bias_t, labels = inputs
        call, real = self.call, self.real
        if call.ce_weight > 0:  # the cross-entropy reads the student's logit at each label
            _checks.ids_in_range(labels, self.vocab_size, "labels", call.ignore_index)
        local = _local_labels(labels, self.shard, real, call.ignore_index)

        def shard_forward(row_stats):
            if real == 0:  # a shard wholly in the padding (or of no rows) holds nothing
                return _empty_partials(xs) if row_stats is None else xs.new_zeros((xs.shape[0], 2), dtype=torch.float64)
            return ops.fused_linear_shard(xs, xt, ws, wt, local, bias_s, bias_t, row_stats, *call.op_options(real),
                                          call.entropy)

        loss, row_stats = _merged_rows(shard_forward(None), shard_forward, labels, call, self.vocab_size,
                                       self.shard.group)
        if call.entropy:
            self.row_entropy = entropy_of(row_stats)
        return loss, (xs, xt, ws, wt, bias_s, bias_t, local, row_stats)

    def backward(self, saved, grad_loss, needs):
        xs, xt, ws, wt, bias_s, bias_t, local, row_stats = saved
        need_dxs, need_dws, need_dbias = needs[0], needs[2], needs[4] and bias_s is not None
        if self.real == 0:
            dxs, dws = torch.zeros_like(xs), torch.zeros_like(ws)
            dbias = torch.zeros_like(bias_s) if bias_s is not None else None
        else:
            dxs, dws, dbias = ops.fused_linear_bwd(grad_loss, xs, xt, ws, wt, local, bias_s, bias_t, row_stats,
                                                   *self.call.op_options(self.real), need_dxs, need_dws, need_dbias)
        return dxs, None, dws, None, dbias, None, None


class _LogitsShard(_ShardLoss):
    """inputs: (zs, zt, labels), this shard's [N, V_shard] columns of the logits."""

    token_inputs, shard_grads = (0, 1, 2), (0,)

    def __init__(self, call: FusedLinearCall, shard: _Shard):
        self.call, self.shard = call, shard

    def forward(self, inputs):
        zs, zt, labels = inputs
        call = self.call

        def shard_forward(row_stats):
            if zs.shape[1] == 0:
                return _empty_partials(zs) if row_stats is None else zs.new_zeros((zs.shape[0], 2), dtype=torch.float64)
            return ops.logits_shard(zs, zt, labels, row_stats, call.ignore_index, call.divergence, call.beta,
                                    call.temperature)

        loss, row_stats = _merged_rows(shard_forward(None), shard_forward, labels, call, self.shard.total,
                                       self.shard.group)
        return loss, (zs, zt, labels, row_stats)

    def backward(self, saved, grad_loss, needs):
        zs, zt, labels, row_stats = saved
        call = self.call
        if zs.shape[1] == 0:
            return torch.zeros_like(zs), None, None
        dzs = ops.logits_bwd(grad_loss, zs, zt, labels, row_stats, call.ignore_index, call.divergence, call.beta,
                             call.temperature)
        return dzs, None, None


class _TopKShard(_ShardLoss):
    """The top-K loss on a vocabulary shard (from hidden states or from logits).

    The shard runs its top-K forward with the ids it holds moved to its own rows and every other id
    put on row 0 with a log-probability of -inf (q = 0: it adds nothing there), and keeps its student
    log-normalizer and its ids' logits; topk_merge_shards finishes the rows from every shard's."""

    def __init__(self, call: TopKCall, shard: _Shard):
        self.call, self.shard = call, shard

    def _local_teacher(self, ids, logprobs):
        shard = self.shard
        if ids.shape[-1] > shard.total:
            raise ValueError(f"K (the last dimension of teacher_ids) must be in [1, V = {shard.total}], got "
                             f"{ids.shape[-1]}")
        _checks.ids_in_range(ids, shard.total, "teacher_ids")
        if not self.call.renormalize:  # "full" takes q as given (topk_linear.py checked nothing here: every rank
            _checks.teacher_mass(logprobs)  # sees these inputs alike, so every rank raises alike)
        held = (ids >= shard.start) & (ids < shard.start + shard.rows)
        return (held, torch.where(held, ids - shard.start, torch.zeros_like(ids)),
                torch.where(held, logprobs, torch.full_like(logprobs, float("-inf"))))

    def _merged(self, local_stats, held, logprobs, labels, float64_logits):
        """(loss, the statistics this shard's backward reads). local_stats None: a shard of no rows."""
        call = self.call
        n, k = logprobs.shape
        if local_stats is None:
            local_stats = logprobs.new_zeros((n, NUM_TOPK_ROW_STATS + k), dtype=torch.float64)
            local_stats[:, 0] = float("-inf")  # an empty softmax state
        z = local_stats[:, NUM_TOPK_ROW_STATS:]
        part = torch.cat([local_stats[:, :2], torch.where(held, z, torch.zeros_like(z))], 1)
        loss, row_stats = ops.topk_merge_shards(_all_gather(part, self.shard.group), logprobs, labels,
                                                call.ignore_index, call.temperature, call.renormalize,
                                                call.divergence, call.weight, float64_logits)
        # The backward reads the whole vocabulary's statistics with this shard's logits at the ids: the
        # others' ids sit on row 0 with q = 0, and there their logit must be row 0's own (the dense part
        # at an id is written from it), or -inf for "topk" (p~ = 0: no sparse term).
        if call.renormalize:
            z = torch.where(held, z, torch.full_like(z, float("-inf")))
        return loss, torch.cat([row_stats[:, :NUM_TOPK_ROW_STATS], z], 1)


class _TopKLinearShard(_TopKShard):
    """inputs: (xs, ws, bias_s, teacher_ids, teacher_logprobs, labels); ws, bias_s: this shard's rows."""

    token_inputs, summed_grads, shard_grads = (0, 3, 4, 5), (0,), (1, 2)

    def forward(self, inputs):
        xs, ws, bias_s, ids, logprobs, labels = inputs
        call = self.call
        held, local_ids, local_logprobs = self._local_teacher(ids, logprobs)
        self.options = (call.ignore_index, call.temperature, call.logit_scale_s, call.renormalize, call.chunk_v,
                        call.divergence, call.weight)
        local_stats = None
        if ws.shape[0] > 0:
            _, local_stats = ops.topk_linear_fwd(xs, ws, local_ids, local_logprobs, labels, bias_s, *self.options)
        loss, row_stats = self._merged(local_stats, held, logprobs, labels, xs.dtype == torch.float64)
        return loss, (xs, ws, bias_s, local_ids, local_logprobs, labels, row_stats)

    def backward(self, saved, grad_loss, needs):
        xs, ws, bias_s, ids, logprobs, labels, row_stats = saved
        if ws.shape[0] == 0:
            return (torch.zeros_like(xs), torch.zeros_like(ws), None if bias_s is None else torch.zeros_like(bias_s),
                    None, None, None)
        dxs, dws, dbias = ops.topk_linear_bwd(grad_loss, xs, ws, ids, logprobs, labels, bias_s, row_stats,
                                              *self.options, needs[0], needs[1], needs[2] and bias_s is not None)
        return dxs, dws, dbias, None, None, None


class _TopKLogitsShard(_TopKShard):
    """inputs: (zs, teacher_ids, teacher_logprobs, labels); zs: this shard's [N, V_shard] columns."""

    token_inputs, shard_grads = (0, 1, 2, 3), (0,)

    def forward(self, inputs):
        zs, ids, logprobs, labels = inputs
        held, local_ids, local_logprobs = self._local_teacher(ids, logprobs)
        self.options = (self.call.ignore_index, self.call.temperature, self.call.renormalize, self.call.divergence,
                        self.call.weight)
        local_stats = None
        if zs.shape[1] > 0:
            _, local_stats = ops.topk_logits_fwd(zs, local_ids, local_logprobs, labels, *self.options)
        loss, row_stats = self._merged(local_stats, held, logprobs, labels, zs.dtype == torch.float64)
        return loss, (zs, local_ids, local_logprobs, labels, row_stats)

    def backward(self, saved, grad_loss, needs):
        zs, ids, logprobs, labels, row_stats = saved
        if zs.shape[1] == 0:
            return torch.zeros_like(zs), None, None, None
        return ops.topk_logits_bwd(grad_loss, zs, ids, logprobs, labels, row_stats, *self.options), None, None, None


@torch.compiler.disable  # collectives and host reads of the layout: run eagerly (a graph break)
def fused_linear_loss(xs: Tensor, xt: Tensor, ws: Tensor, wt: Tensor, labels: Tensor | None,
                      bias_s: Tensor | None, bias_t: Tensor | None, call: FusedLinearCall, group,
                      tokens_sharded: bool = False, teacher_whole: bool = False) -> Tensor:
    """Per-token losses [N] of 2-D xs, xt over the vocabulary shards ws, wt of `group`'s ranks
    (fused_linear.py has validated the rest). tokens_sharded: xs holds this rank's tokens alone.
    teacher_whole: wt (and bias_t) is the teacher's whole lm_head, of which this rank takes ws's rows."""
    shard, wt, bias_t = fused_linear_layout(ws, wt, bias_t, call, group, teacher_whole, xs.device)
    return fused_linear_shard_loss(xs, xt, ws, wt, labels, bias_s, bias_t, call, shard, tokens_sharded)[0]


def fused_linear_layout(ws: Tensor, wt: Tensor, bias_t: Tensor | None, call: FusedLinearCall, group,
                        teacher_whole: bool, device) -> tuple:
    """(this rank's _Shard, its wt and bias_t rows): one all-gather of the ranks' row counts.
    teacher_whole: wt (and bias_t) is the teacher's whole lm_head, of which this rank takes ws's rows."""
    shard = _shard_layout(ws.shape[0], ws.shape[0] if teacher_whole else wt.shape[0], device, group, call.entropy)
    if teacher_whole:
        if wt.shape[0] < shard.total:
            raise ValueError(f"wt, the teacher's whole lm_head, has {wt.shape[0]} rows, fewer than the student's "
                             f"sharded {shard.total}")
        wt = wt[shard.start: shard.start + shard.rows]
        bias_t = None if bias_t is None else bias_t[shard.start: shard.start + shard.rows]
    if call.vocab_size is not None and call.vocab_size > shard.total:
        raise ValueError(f"vocab_size must be at most the rows of the whole (sharded) vocabulary, {shard.total}, got "
                         f"{call.vocab_size}")
    return shard, wt, bias_t


def fused_linear_shard_loss(xs: Tensor, xt: Tensor, ws: Tensor, wt: Tensor, labels: Tensor | None,
                            bias_s: Tensor | None, bias_t: Tensor | None, call: FusedLinearCall, shard: _Shard,
                            tokens_sharded: bool = False) -> tuple[Tensor, Tensor]:
    """fused_linear_loss on a layout fused_linear_layout gave: the recompute path's per-token losses [N], and
    with call.entropy each token's student entropy [N] (else an empty tensor)."""
    shard_loss = _FusedLinearShard(call, shard)
    tokens_per_rank = None
    if tokens_sharded:
        tokens_per_rank, shard_loss.summed_anywhere = token_layout(xs, shard.group)
    return _VocabParallel.apply(shard_loss, shard.group, tokens_per_rank,
                                xs, xt, ws, wt, bias_s, bias_t, labels)


@torch.compiler.disable  # collectives and host reads of the layout: run eagerly (a graph break)
def logits_loss(zs: Tensor, zt: Tensor, labels: Tensor | None, call: FusedLinearCall, group) -> Tensor:
    """Per-row losses [N] of the logits' vocabulary shards zs, zt: [N, V_shard] (logits.py has validated them)."""
    shard = _shard_layout(zs.shape[1], zt.shape[1], zs.device, group)
    return _VocabParallel.apply(_LogitsShard(call, shard), group, None, zs, zt, labels)[0]


@torch.compiler.disable  # collectives and host reads of the layout: run eagerly (a graph break)
def topk_loss(xs: Tensor, ws: Tensor, bias_s: Tensor | None, teacher_ids: Tensor, teacher_logprobs: Tensor,
              labels: Tensor | None, call: TopKCall, group, tokens_sharded: bool = False) -> Tensor:
    """Per-token top-K losses [N] of 2-D xs over the vocabulary shards ws of `group`'s ranks (teacher ids
    global: their range is checked here, on the ids every rank holds alike)."""
    shard = _shard_layout(ws.shape[0], ws.shape[0], xs.device, group)
    shard_loss = _TopKLinearShard(call, shard)
    tokens_per_rank = None
    if tokens_sharded:
        tokens_per_rank, shard_loss.summed_anywhere = token_layout(xs, group)
    return _VocabParallel.apply(shard_loss, group, tokens_per_rank,
                                xs, ws, bias_s, teacher_ids, teacher_logprobs, labels)[0]


@torch.compiler.disable  # collectives and host reads of the layout: run eagerly (a graph break)
def topk_logits_loss(zs: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, labels: Tensor | None,
                     call: TopKCall, group) -> Tensor:
    """Per-row top-K losses [N] of the logits' vocabulary shard zs: [N, V_shard] (teacher ids global)."""
    shard = _shard_layout(zs.shape[1], zs.shape[1], zs.device, group)
    return _VocabParallel.apply(_TopKLogitsShard(call, shard), group, None, zs, teacher_ids, teacher_logprobs,
                                labels)[0]


def _replicate_class():
    return sys.modules["torch.distributed.tensor"].Replicate


def _dtensor_class():
    """DTensor, or None where no DTensor can exist yet (its module not imported: nothing to import here,
    which keeps torch.compile's traces of single-device calls free of imports)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    DTensor = _dtensor_class()
    return DTensor is not None and isinstance(t, DTensor)


def _local(t):
    """A DTensor's local tensor (differentiable), anything else as it is."""
    return t.to_local() if is_dtensor(t) else t


def _weight_layout(w: Tensor, name: str) -> str:
    """"shard" (dim 0 over a 1-D mesh) or "replicate"; raises for every other layout."""
    from torch.distributed.tensor import Replicate, Shard

    if w.device_mesh.ndim != 1:
        raise ValueError(f"{name} must be a DTensor over a 1-D device mesh, got a {w.device_mesh.ndim}-D mesh (HSDP, or "
                         f"FSDP2 with tensor parallelism) which nitrobrew does not take yet. process_group= with the "
                         f"local shards is right only where every rank of the group holds the same tokens")
    placement = w.placements[0]
    if isinstance(placement, Shard) and placement.dim == 0:
        return "shard"
    if isinstance(placement, Replicate):
        return "replicate"
    raise ValueError(f"{name} must be sharded on dim 0 (the vocabulary) or replicated, got placements "
                     f"{tuple(w.placements)}")


def sharded_weights(xs, xt, ws, wt, bias_s, bias_t):
    """DTensor weights as local tensors (wt, xt, bias_t None for the student-only top-K loss), without
    communicating: None when neither ws nor wt is a DTensor, else a ShardedWeights. Raises for the
    layouts it does not support."""
    DTensor = _dtensor_class()
    if DTensor is None or not (isinstance(ws, DTensor) or isinstance(wt, DTensor)):
        return None
    if not isinstance(ws, DTensor):
        raise ValueError("wt is a DTensor but ws is not: shard the student's lm_head on dim 0 as well, or gather wt")
    layout_s = _weight_layout(ws, "ws")
    layout_t = _weight_layout(wt, "wt") if isinstance(wt, DTensor) else "whole"
    if isinstance(wt, DTensor) and wt.device_mesh != ws.device_mesh:
        raise ValueError("ws and wt must be DTensors over one device mesh")
    local = tuple(_local(t) for t in (xs, xt, ws, wt, bias_s, bias_t))
    if layout_s == "replicate":  # whole weights on every rank: the single-device loss
        if layout_t == "shard":
            raise ValueError("ws is replicated but wt is sharded: shard both lm_heads on dim 0, or neither")
        return ShardedWeights(local, None, False, False)
    tokens_sharded = not isinstance(xs, DTensor)
    if not tokens_sharded and not all(isinstance(p, _replicate_class()) for p in xs.placements):
        raise ValueError(f"xs must be a plain tensor (each rank's own tokens, as under FSDP2) or a DTensor "
                         f"replicated over the mesh (tensor parallelism), got placements {tuple(xs.placements)}")
    return ShardedWeights(local, ws.device_mesh.get_group(), tokens_sharded, wt is not None and layout_t != "shard")


@dataclass(frozen=True)
class ShardedWeights:
    """What sharded_weights found: the arguments (xs, xt, ws, wt, bias_s, bias_t) as local tensors, the
    mesh's group (None: whole weights), whether xs holds this rank's tokens alone (FSDP2), and whether
    wt is the teacher's whole lm_head (this rank then takes ws's rows of it, fused_linear_loss)."""

    tensors: tuple
    group: object
    tokens_sharded: bool
    teacher_whole: bool
