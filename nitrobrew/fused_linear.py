"""Distillation losses computed from hidden states and unembedding matrices.

For each token n, with student logits s = softcap_s(logit_scale_s * (xs[n] @ ws.T + bias_s)) / temperature
and teacher logits t = softcap_t(logit_scale_t * (xt[n] @ wt.T + bias_t)) / temperature over the first
`vocab_size` rows of the weights (bias and logit scale optional: lm_head biases, Cohere's or Granite's
logit multipliers), p = softmax(s) (student) and q = softmax(t) (teacher):

    forward_kl:  KL(q || p) = sum(q * (log q - log p))
    reverse_kl:  KL(p || q) = sum(p * (log p - log q))
    jsd(beta):   beta * KL(q || M) + (1 - beta) * KL(p || M),  M = (1 - beta) * p + beta * q
                 (beta = 0 is forward_kl, beta = 1 is reverse_kl)
    skew_forward_kl(alpha):  KL(q || M),  M = alpha * q + (1 - alpha) * p
    skew_reverse_kl(alpha):  KL(p || M),  M = alpha * p + (1 - alpha) * q
                 (alpha = 0 is forward_kl / reverse_kl; DistiLLM's skew KLs)
    tvd:         1/2 * sum(|p - q|)   (total variation; subgradient sign(0) = 0 where p = q)

plus, with ce_weight > 0, ce_weight * cross_entropy of the student's logits at temperature 1 at labels[n].
The [tokens x vocab] logits are never written to memory whole. Two paths compute them: the recompute path
tiles the vocabulary, reduces each tile into per-token running statistics and recomputes the tiles in the
backward pass; the training path (when autograd needs the gradients of a scalar loss) forms the
gradients during the forward from token chunks whose logits are formed once (_forward_grads.py).
nitrobrew.reference holds the same definitions as plain (materializing) PyTorch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nitrobrew import _checks, _forward_grads, _training_shards, distributed
from nitrobrew._divergences import divergence_functions
from nitrobrew._extension import kernel_device_types
from nitrobrew._reduction import reduce_rows
from nitrobrew._registration import ops, register_recompute_op, row_outputs

__all__ = ["forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd"]

# Columns of the forward's per-row statistics (RowStat in csrc/divergence/row_stats.h), and the column of
# the student's entropy (kEntropyS: formed where the forward's `entropy` option asks for it).
NUM_ROW_STATS = 8
ENTROPY_COLUMN = 7
# The options of fused_linear_fwd that its backward takes too: all but the last, `entropy`.
_BACKWARD_OPTIONS = 11


def _fake_forward(xs, xt, ws, wt, labels, bias_s, bias_t, *options):
    torch._check(xs.dim() == 2 and xt.dim() == 2, lambda: "xs and xt must be 2-D")
    torch._check(ws.dim() == 2 and wt.dim() == 2, lambda: "ws and wt must be 2-D")
    torch._check(xs.shape[0] == xt.shape[0], lambda: "xs and xt must have the same number of rows")
    torch._check(ws.shape[1] == xs.shape[1], lambda: "ws must be [V, D_s]")
    torch._check(wt.shape[1] == xt.shape[1], lambda: "wt must be [V, D_t]")
    return row_outputs(xs, xs.shape[0], NUM_ROW_STATS)


# fused_linear_fwd(xs, xt, ws, wt, labels, bias_s, bias_t, *options); gradients to xs, ws and bias_s (the
# teacher's xt, wt, bias_t get none).
register_recompute_op("fused_linear", n_tensors=7, differentiable=(0, 2, 5), fake_forward=_fake_forward,
                      needs_flags=True, backward_options=_BACKWARD_OPTIONS)

# Read once at import: torch.compile cannot trace the dispatcher query itself.
_KERNEL_DEVICE_TYPES = kernel_device_types("fused_linear_fwd")


def _resolve_vocab_size(ws: Tensor, wt: Tensor, vocab_size) -> int:
    rows_s, rows_t = ws.shape[0], wt.shape[0]
    if vocab_size is None:
        if rows_s != rows_t:
            raise ValueError(
                f"ws has {rows_s} rows and wt has {rows_t}: pass vocab_size=<number of real vocabulary "
                f"entries> (at most {min(rows_s, rows_t)}); rows past it are treated as padding"
            )
        return rows_s
    vocab_size = _checks.optional_positive_int(vocab_size, "vocab_size")
    if vocab_size > min(rows_s, rows_t):
        raise ValueError(
            f"vocab_size must be at most the row count of ws ({rows_s}) and wt ({rows_t}), got {vocab_size}"
        )
    return vocab_size


def _fused_linear_loss(
    divergence: str,
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: Tensor | None = None,
    ignore_index: int = -100,
    chunk_V: int | None = None,
    ce_weight: float = 0.0,
    softcap_s: float | None = None,
    softcap_t: float | None = None,
    vocab_size: int | None = None,
    bias_s: Tensor | None = None,
    bias_t: Tensor | None = None,
    logit_scale_s: float = 1.0,
    logit_scale_t: float = 1.0,
    process_group=None,
    grad_in_forward: bool | None = None,
    grad_chunk_mib: int | None = None,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The one signature of every divergence (beta: jsd's beta or the skew KLs' alpha, _divergences.py)."""
    for name, value in (("xs", xs), ("xt", xt), ("ws", ws), ("wt", wt)):
        _checks.tensor(value, name)
        _checks.floating(value, name)
    if xs.dim() < 1 or xt.dim() < 1:
        raise ValueError(f"xs and xt must be [..., D] tensors, got shapes {tuple(xs.shape)} and {tuple(xt.shape)}")
    if ws.dim() != 2 or wt.dim() != 2:
        hint = (" (an empty weight: a DeepSpeed ZeRO-3 parameter read outside its module's forward? "
                "docs/distributed.md)" if ws.numel() == 0 or wt.numel() == 0 else "")
        raise ValueError(f"ws and wt must be [V, D] matrices, got shapes {tuple(ws.shape)} and {tuple(wt.shape)}{hint}")
    if xs.shape[-1] == 0 or xt.shape[-1] == 0:
        raise ValueError(f"xs and xt must have a hidden size D >= 1 (their last dimension), got shapes "
                         f"{tuple(xs.shape)} and {tuple(xt.shape)}")
    sharded = distributed.sharded_weights(xs, xt, ws, wt, bias_s, bias_t)
    tokens_sharded = teacher_whole = False
    if sharded is not None:  # DTensor weights: their local shards, over their mesh's group
        if process_group is not None:
            raise ValueError("ws and wt are DTensors: pass them without process_group (their mesh's group is used)")
        (xs, xt, ws, wt, bias_s, bias_t), process_group = sharded.tensors, sharded.group
        tokens_sharded, teacher_whole = sharded.tokens_sharded, sharded.teacher_whole
    # A shard may hold no rows (a DTensor's torch.chunk layout over more ranks than rows).
    if (ws.shape[0] == 0 or wt.shape[0] == 0) and process_group is None:
        raise ValueError(f"ws and wt must hold at least one vocabulary row each, got shapes {tuple(ws.shape)} and "
                         f"{tuple(wt.shape)}")
    lead_shape = xs.shape[:-1]
    if xt.shape[:-1] != lead_shape:
        raise ValueError(
            f"xs and xt must have the same leading shape, got {tuple(xs.shape)} and {tuple(xt.shape)}"
        )
    if ws.shape[1] != xs.shape[-1]:
        raise ValueError(f"ws must be [V, D_s] with D_s = xs.shape[-1] = {xs.shape[-1]}, got {tuple(ws.shape)}"
                         f"{_checks.logits_hint(xs, ws)}")
    if wt.shape[1] != xt.shape[-1]:
        raise ValueError(f"wt must be [V, D_t] with D_t = xt.shape[-1] = {xt.shape[-1]}, got {tuple(wt.shape)}"
                         f"{_checks.logits_hint(xt, wt)}")
    _checks.same_device({"xs": xs, "xt": xt, "ws": ws, "wt": wt})
    xs, xt, ws, wt = _checks.autocast_inputs(xs, xt, ws, wt)
    if ws.dtype != xs.dtype or wt.dtype != xt.dtype or xt.dtype != xs.dtype:
        mismatch = "xs and ws" if ws.dtype != xs.dtype else "xt and wt" if wt.dtype != xt.dtype else "student and teacher"
        raise TypeError(
            f"xs, xt, ws and wt must share one dtype ({mismatch} differ): got xs {xs.dtype}, xt {xt.dtype}, "
            f"ws {ws.dtype}, wt {wt.dtype}. Cast them to one dtype, or call under torch.autocast, which casts "
            f"all four to its dtype"
        )
    _checks.kernel_device(xs.device, _KERNEL_DEVICE_TYPES)
    bias_s = _checks.bias(bias_s, ws, "bias_s", "ws")
    bias_t = _checks.bias(bias_t, wt, "bias_t", "wt")
    logit_scale_s = _checks.positive_number(logit_scale_s, "logit_scale_s")
    logit_scale_t = _checks.positive_number(logit_scale_t, "logit_scale_t")
    temperature = _checks.positive_number(temperature, "temperature")
    beta = _checks.unit_interval(beta, "beta")
    reduction = _checks.reduction(reduction)
    labels = _checks.labels(labels, lead_shape, xs.device)
    ignore_index = _checks.ignore_index(ignore_index)
    ce_weight = _checks.non_negative_number(ce_weight, "ce_weight")
    if ce_weight > 0 and labels is None:
        raise ValueError("ce_weight > 0 adds the hard-label cross-entropy and needs labels")
    softcap_s = _checks.optional_positive_number(softcap_s, "softcap_s")
    softcap_t = _checks.optional_positive_number(softcap_t, "softcap_t")
    chunk_V = _checks.optional_positive_int(chunk_V, "chunk_V")
    chunk_bytes = _forward_grads.chunk_budget_bytes(grad_chunk_mib)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy must be True or False, got {return_entropy!r}")
    train = _forward_grads.wanted(grad_in_forward, reduction, (xs, ws, bias_s), xs.device.type)
    flat_labels = labels.reshape(-1) if labels is not None else None
    if process_group is not None:  # a vocabulary shard per rank: vocab_size is the whole vocabulary's
        call = distributed.FusedLinearCall(
            divergence, beta, temperature, ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t, ignore_index,
            _checks.optional_positive_int(vocab_size, "vocab_size"), chunk_V or 0, return_entropy)
        loss, entropy = _sharded_loss(xs, xt, ws, wt, flat_labels, bias_s, bias_t, call, process_group,
                                      tokens_sharded, teacher_whole, reduction, train, grad_in_forward, chunk_bytes)
        return (loss, entropy.reshape(lead_shape)) if return_entropy else loss
    vocab_size = _resolve_vocab_size(ws, wt, vocab_size)
    if ce_weight > 0:  # the cross-entropy reads the student's logit at each label
        _checks.ids_in_range(labels, vocab_size, "labels", ignore_index)

    xs_2d, xt_2d = xs.reshape(-1, xs.shape[-1]), xt.reshape(-1, xt.shape[-1])
    options = (ignore_index, divergence, beta, temperature, ce_weight, softcap_s, softcap_t, logit_scale_s,
               logit_scale_t, vocab_size)
    if train:  # the gradients formed in the forward (_forward_grads.py)
        needs = (xs.requires_grad, ws.requires_grad, bias_s is not None and bias_s.requires_grad)
        loss, entropy = _forward_grads.FusedLinearForwardGrads.apply(
            xs_2d, xt_2d, ws, wt, flat_labels, bias_s, bias_t, options, reduction, chunk_bytes, needs, None,
            return_entropy)
    else:
        rows, row_stats = ops.fused_linear_fwd(xs_2d, xt_2d, ws, wt, flat_labels, bias_s, bias_t, *options,
                                               chunk_V or 0, return_entropy)
        loss = reduce_rows(rows, lead_shape, reduction, flat_labels, ignore_index)
        entropy = row_stats[:, ENTROPY_COLUMN].clone()  # not a view of what the backward saved
    return (loss, entropy.reshape(lead_shape)) if return_entropy else loss


@torch.compiler.disable  # collectives and host reads of the layout: run eagerly (a graph break)
def _sharded_loss(xs, xt, ws, wt, flat_labels, bias_s, bias_t, call, group, tokens_sharded, teacher_whole, reduction,
                  train, grad_in_forward, chunk_bytes):
    """(loss, entropy) over vocabulary shards: the training path where it runs (_training_shards.py), else the
    recompute path's (distributed.py); the entropy of this rank's tokens where call.entropy, else empty."""
    lead_shape = xs.shape[:-1]
    xs, xt = xs.reshape(-1, xs.shape[-1]), xt.reshape(-1, xt.shape[-1])
    # Checks the kernels would make, here on every rank alike: a rank whose shard holds no rows runs none
    # of them, and would wait in a collective for ranks that raised.
    if xs.device.type == "cuda" and xs.dtype == torch.float64:
        raise TypeError("float64 inputs are supported on the CPU only")
    if train and not _training_shards.runs_on(xs.device.type):
        if grad_in_forward:
            raise NotImplementedError(f"grad_in_forward=True: the training path does not run over vocabulary shards "
                                      f"on {xs.device.type}; grad_in_forward=None or False takes the recompute path")
        train = False
    # Data parallelism (FSDP2: each rank's own tokens) takes the training path only when asked for: it needs
    # the same upstream gradient on every rank, which the forward cannot know (docs/distributed.md).
    train = train and (grad_in_forward is True or not tokens_sharded)
    shard, wt, bias_t = distributed.fused_linear_layout(ws, wt, bias_t, call, group, teacher_whole, xs.device)
    if train:
        shards = _training_shards.plan(call, shard, xs, tokens_sharded)
        options = call.op_options(shards.real)[:-1]
        return _training_shards.loss(xs, xt, ws, wt, flat_labels, bias_s, bias_t, options, reduction, chunk_bytes,
                                     shards)
    loss, entropy = distributed.fused_linear_shard_loss(xs, xt, ws, wt, flat_labels, bias_s, bias_t, call, shard,
                                                        tokens_sharded)
    return reduce_rows(loss, lead_shape, reduction, flat_labels, call.ignore_index), entropy


_ARGUMENTS = """From hidden states and unembeddings: the student's logits are
softcap_s(logit_scale_s * (xs @ ws.T + bias_s)) / temperature, the teacher's likewise with xt, wt, bias_t,
logit_scale_t and softcap_t, over the first vocab_size rows of the weights; they are never written to memory.

Args:
    xs: [..., D_s] student hidden states. xt: [..., D_t] teacher hidden states, same leading shape.
    ws: [V, D_s] student unembedding. wt: [V, D_t] teacher unembedding (no gradient).
    beta (jsd only): the mixture weight, in [0, 1].
    alpha (skew_forward_kl and skew_reverse_kl only): the skew, in [0, 1].
    temperature: divides both models' (soft-capped) logits.
    reduction: "none" (leading shape of xs, masked tokens 0), "sum", "mean" (sum over unmasked
        tokens / their number, 0 when none) or "batchmean" (= "mean").
    labels: int64, leading shape of xs; tokens whose label is ignore_index are masked.
    ignore_index: the label value of masked tokens.
    chunk_V: vocabulary tile width of the CPU kernel on the recompute path (None = automatic).
    ce_weight: adds ce_weight * cross-entropy of the student's temperature-1 logits at labels.
    softcap_s, softcap_t: Gemma-style cap c * tanh(z / c) per model, before the temperature.
    vocab_size: real vocabulary entries when ws / wt are padded; rows past it are excluded.
    bias_s, bias_t: [V] lm_head biases (one entry per row of ws / wt), or None.
    logit_scale_s, logit_scale_t: positive multipliers of each model's logits, applied before the
        soft-cap (Cohere's logit_scale, 1 / Granite's logits_scaling); 1.0 = none.
    grad_in_forward: None (automatic), True or False. The training path forms the gradients during the
        forward from token chunks whose logits are formed once (four matrix products in all; the backward
        only scales them by the upstream gradient); the recompute path saves per-row statistics and
        recomputes the logits in the backward (six products, any per-token upstream gradient). The
        training path needs a scalar loss (reduction "sum" or "mean") and runs only where autograd records
        a graph for xs, ws or bias_s. Automatic: the training path wherever it can run (CPU and CUDA),
        except under torch.compile and over vocabulary shards sharded by FSDP2, where it needs the same
        upstream gradient on every rank (pass True; tensor parallelism's take it: docs/distributed.md); it
        measured faster (docs/performance.md) at up to grad_chunk_mib more memory, and past 4 chunks of
        16-bit G (long sequences) 2 more bytes per entry of ws for dws accumulated in float32. False keeps
        the recompute path's smaller footprint.
    grad_chunk_mib: the training path's working set bound in MiB (default 2048): a chunk's float32 logits
        and its dLoss/dz (at least one token's). Larger chunks read and write dws fewer times. The
        gradients wanted when the loss is formed (requires_grad) are the ones formed: autograd.grad of
        fewer inputs pays for them all. Under torch.compile the training path specializes its graph on
        the number of tokens.
    return_entropy: also return the student's entropy per token, -sum_v p_v log p_v of its
        temperature-scaled distribution (what TRL's DistillationTrainer logs), formed in the same pass:
        (loss, entropy) with entropy of xs's leading shape, in the loss's dtype, masked tokens 0, no
        gradient. It costs an exponential per student logit. Over vocabulary shards every rank must
        pass the same value (checked), and each gets its own tokens' entropy (every token where xs is the
        same on every rank).
    process_group: a torch.distributed group over which the vocabulary is sharded: each rank holds
        a contiguous shard of ws, wt (and the biases), in rank order; xs, xt and labels are the same
        on every rank; vocab_size is the whole vocabulary's. Every rank gets the whole vocabulary's
        loss, xs.grad whole and ws.grad of its shard (nitrobrew.distributed). Weights given as
        DTensors sharded on dim 0 need no group (see nitrobrew.distributed for the two cases).

Returns the loss in float32 (float64 for float64 inputs), and with return_entropy the entropy per token.
Gradients flow to xs, ws and bias_s.
nitrobrew.reference holds the same definitions as plain (materializing) PyTorch.
"""

forward_kl, reverse_kl, jsd, skew_forward_kl, skew_reverse_kl, tvd = divergence_functions(
    _fused_linear_loss, __name__, _ARGUMENTS)
