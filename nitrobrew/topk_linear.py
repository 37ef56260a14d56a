"""Distillation against a teacher's top-K log-probabilities, from the student's hidden states.

The teacher is what was stored offline: for each token, the ids of its K most likely tokens and their
log-probabilities over its full vocabulary. The student's logits
s = logit_scale_s * (xs[n] @ ws.T + bias_s) / temperature are never written to memory: for normalize="full" a tiled online pass gives the log-normalizer over the
vocabulary and picks the K logits out of its tiles, and the backward recomputes the tiles; for "topk"
the K logits come from K gathered rows of ws. nitrobrew.logits.topk_kl
computes the same loss from logits the caller holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nitrobrew import _checks, _divergences, _forward_grads, _training_shards, distributed
from nitrobrew._extension import kernel_device_types
from nitrobrew._reduction import reduce_rows
from nitrobrew._registration import ops, register_recompute_op, row_outputs

__all__ = ["topk_kl"]

# Columns of the top-K ops' per-row statistics before the K student logits (TopKRowStat in
# csrc/divergence/topk_params.h).
NUM_TOPK_ROW_STATS = distributed.NUM_TOPK_ROW_STATS


def _fake_forward(xs, ws, teacher_ids, teacher_logprobs, labels, bias_s, *options):
    torch._check(xs.dim() == 2 and ws.dim() == 2 and teacher_ids.dim() == 2,
                 lambda: "xs must be [N, D], ws [V, D] and teacher_ids [N, K]")
    return row_outputs(xs, xs.shape[0], NUM_TOPK_ROW_STATS + teacher_ids.shape[1], dtype=torch.float64)


# topk_linear_fwd(xs, ws, teacher_ids, teacher_logprobs, labels, bias_s, *options); gradients to xs, ws
# and bias_s.
register_recompute_op("topk_linear", n_tensors=6, differentiable=(0, 1, 5), fake_forward=_fake_forward,
                      needs_flags=True)

_KERNEL_DEVICE_TYPES = kernel_device_types("topk_linear_fwd")


def topk_kl(xs: Tensor, ws: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, *, normalize: str = "full",
            divergence: str = "forward_kl", beta: float | None = None, alpha: float | None = None,
            temperature: float = 1.0, reduction: str = "mean", labels: Tensor | None = None,
            ignore_index: int = -100, chunk_V: int | None = None, bias_s: Tensor | None = None,
            logit_scale_s: float = 1.0, grad_in_forward: bool | None = None, grad_chunk_mib: int | None = None,
            process_group=None) -> Tensor:
    """A divergence against a teacher's top-K log-probabilities (forward KL by default), per token, from hidden
    states.

    Args:
        xs: [..., D] student hidden states. ws: [V, D] student unembedding.
        teacher_ids: [..., K] int64 ids in [0, V), any order. teacher_logprobs: [..., K] float, the teacher's
            log-probabilities (over its full vocabulary) of those tokens; -inf entries contribute 0.
        normalize: "full": the student's log-probabilities are normalized over the whole vocabulary and
            q_k = exp(teacher_logprobs_k) is used as given (its sum may be < 1); "topk": both are
            renormalized over the K ids.
        divergence: "forward_kl" (the default: KL(teacher || student)); with normalize="topk" also "reverse_kl",
            "jsd" (its weight beta, default 0.5), "skew_forward_kl" and "skew_reverse_kl" (alpha, default 0.1)
            and "tvd", as nitrobrew's functions of those names define them, between the two distributions
            renormalized over the K ids. "full" takes forward KL only: the others need the teacher's
            probabilities beyond its K ids.
        temperature: divides the student's logits only.
        reduction, labels, ignore_index: as in nitrobrew.forward_kl.
        chunk_V: vocabulary chunk width of the CPU kernel (None = automatic).
        bias_s: the student's [V] lm_head bias, or None. logit_scale_s: a positive multiplier of its logits
            (Cohere's logit_scale, 1 / Granite's logits_scaling), before the temperature.
        grad_in_forward, grad_chunk_mib: the training path, as in nitrobrew.forward_kl, for normalize="full"
            (its gradient touches every logit): the gradients formed in the forward from token chunks of
            float32 logits, three matrix products in all. None (automatic) takes it on CUDA, where it measured
            0.85-0.90x the recompute path's step, and keeps the recompute path on the CPU, where it measured as
            fast. normalize="topk" always takes the recompute path, which forms only the K logits a token needs.
            Over vocabulary shards (process_group=, DTensor ws) it runs when asked for (True; under FSDP2 the
            upstream gradient must be the same on every rank: docs/distributed.md).
        process_group: a torch.distributed group over which the vocabulary is sharded: each rank holds a
            contiguous shard of ws (and bias_s), in rank order; xs and the teacher (whose ids stay global)
            are the same on every rank. Every rank gets the whole vocabulary's loss, xs.grad whole and
            ws.grad of its shard. ws given as a DTensor sharded on dim 0 needs no group
            (nitrobrew.distributed).

    Forward KL's loss per token is sum_k q_k (log q_k - log p_{id_k}). Returns float32 (float64 for float64 inputs);
    gradients flow to xs, ws and bias_s. Masked rows' ids are not read (padding's -1 is fine there); with
    normalize="full" a row whose teacher mass sum_k q_k passes 1.25 (probabilities or logits given as
    log-probabilities) raises a ValueError; other ids outside [0, V) raise an IndexError naming the first one and
    its position
    (on CUDA at the cost of a host synchronization; skipped while torch.compile traces or a CUDA graph
    captures, where such a row's loss and gradient come out NaN instead).
    """
    for name, value in (("xs", xs), ("ws", ws)):
        _checks.tensor(value, name)
        _checks.floating(value, name)
    sharded = distributed.sharded_weights(xs, None, ws, None, bias_s, None)
    tokens_sharded = False
    if sharded is not None:  # a DTensor ws: its local shard, over its mesh's group
        if process_group is not None:
            raise ValueError("ws is a DTensor: pass it without process_group (its mesh's group is used)")
        (xs, _, ws, _, bias_s, _), process_group, tokens_sharded = sharded.tensors, sharded.group, sharded.tokens_sharded
    # A shard may hold no rows (a DTensor's torch.chunk layout over more ranks than rows).
    min_rows = 1 if process_group is None else 0
    if xs.dim() < 1 or ws.dim() != 2 or ws.shape[1] != xs.shape[-1] or ws.shape[0] < min_rows or xs.shape[-1] == 0:
        raise ValueError(f"xs must be [..., D] and ws [V, D] with V >= 1 and D >= 1, got {tuple(xs.shape)} and "
                         f"{tuple(ws.shape)}{_checks.logits_hint(xs, ws)}")
    lead_shape = xs.shape[:-1]
    vocab = ws.shape[0] if process_group is None else None  # sharded: checked over the whole vocabulary
    _checks.topk_teacher(teacher_ids, teacher_logprobs, normalize, lead_shape, vocab, of="xs")
    weight = _divergences.topk_weight(divergence, normalize, beta, alpha)
    _checks.same_device({"xs": xs, "ws": ws, "teacher_ids": teacher_ids, "teacher_logprobs": teacher_logprobs})
    xs, ws = _checks.autocast_inputs(xs, ws)
    if ws.dtype != xs.dtype:
        raise TypeError(f"xs and ws must share one dtype, got {xs.dtype} and {ws.dtype} (or call under "
                        f"torch.autocast, which casts both to its dtype)")
    _checks.kernel_device(xs.device, _KERNEL_DEVICE_TYPES)
    bias_s = _checks.bias(bias_s, ws, "bias_s", "ws")
    logit_scale_s = _checks.positive_number(logit_scale_s, "logit_scale_s")
    temperature = _checks.positive_number(temperature, "temperature")
    reduction = _checks.reduction(reduction)
    labels = _checks.labels(labels, lead_shape, xs.device)
    ignore_index = _checks.ignore_index(ignore_index)
    teacher_ids, teacher_logprobs = _checks.topk_rows(teacher_ids, teacher_logprobs, normalize, labels, ignore_index,
                                                      vocab)
    chunk_V = _checks.optional_positive_int(chunk_V, "chunk_V")
    k = teacher_ids.shape[-1]
    flat_labels = labels.reshape(-1) if labels is not None else None
    chunk_bytes = _forward_grads.chunk_budget_bytes(grad_chunk_mib)
    if normalize == "topk" and grad_in_forward:
        raise ValueError('grad_in_forward=True runs normalize="full" only: with "topk" the recompute path forms '
                         'just the K logits a token needs, which no chunk of full logits can beat')
    train = normalize == "full" and _forward_grads.wanted(grad_in_forward, reduction, (xs, ws, bias_s), xs.device.type,
                                                          _forward_grads.TOPK_AUTOMATIC_DEVICES)
    if process_group is not None:
        call = distributed.TopKCall(temperature, normalize == "topk", ignore_index, logit_scale_s, chunk_V or 0,
                                    divergence, weight)
        # Over vocabulary shards the training path runs when asked for (not yet measured against the
        # recompute path there; under FSDP2 it needs the same upstream gradient on every rank).
        if train and grad_in_forward:
            if not _training_shards.runs_on(xs.device.type):
                raise NotImplementedError(f"grad_in_forward=True: the training path does not run over vocabulary "
                                          f"shards on {xs.device.type}; grad_in_forward=None or False takes the "
                                          f"recompute path")
            return _training_shards.topk_loss(xs.reshape(-1, xs.shape[-1]), ws, bias_s, teacher_ids.reshape(-1, k),
                                              teacher_logprobs.reshape(-1, k), flat_labels, call, process_group,
                                              tokens_sharded, reduction, chunk_bytes)
        loss = distributed.topk_loss(xs.reshape(-1, xs.shape[-1]), ws, bias_s, teacher_ids.reshape(-1, k),
                                     teacher_logprobs.reshape(-1, k), flat_labels, call, process_group, tokens_sharded)
        return reduce_rows(loss, lead_shape, reduction, flat_labels, ignore_index)
    if train:  # the gradients formed in the forward (_forward_grads.py)
        needs = (xs.requires_grad, ws.requires_grad, bias_s is not None and bias_s.requires_grad)
        return _forward_grads.TopKForwardGrads.apply(xs.reshape(-1, xs.shape[-1]), ws, teacher_ids.reshape(-1, k),
                                                     teacher_logprobs.reshape(-1, k), flat_labels, bias_s,
                                                     (ignore_index, temperature, logit_scale_s), reduction,
                                                     chunk_bytes, needs)
    loss, _ = ops.topk_linear_fwd(xs.reshape(-1, xs.shape[-1]), ws, teacher_ids.reshape(-1, k),
                                  teacher_logprobs.reshape(-1, k), flat_labels, bias_s, ignore_index, temperature,
                                  logit_scale_s, normalize == "topk", chunk_V or 0, divergence, weight)
    return reduce_rows(loss, lead_shape, reduction, flat_labels, ignore_index)
