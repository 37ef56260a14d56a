"""Distillation losses from logits the caller already holds.

For each row n of zs, zt: [..., V], with s = zs[n] / temperature, t = zt[n] / temperature,
p = softmax(s) (student) and q = softmax(t) (teacher):

    forward_kl:  KL(q || p)      reverse_kl:  KL(p || q)
    jsd(beta):   beta * KL(q || M) + (1 - beta) * KL(p || M),  M = (1 - beta) * p + beta * q
    skew_forward_kl(alpha):  KL(q || M),  M = alpha * q + (1 - alpha) * p
    skew_reverse_kl(alpha):  KL(p || M),  M = alpha * p + (1 - alpha) * q
                 (alpha = 0 is forward_kl / reverse_kl; DistiLLM's skew KLs)
    tvd:         1/2 * sum(|p - q|)   (total variation; subgradient sign(0) = 0 where p = q)

Entries of -inf (masked or padded vocabulary) have probability 0 and contribute 0 (0 log 0 = 0);
every row needs a finite logit in both models (on the CPU a row without one is an error; on CUDA its
loss and gradient are NaN, as a check would need a host synchronization). Only zs receives a
gradient. The forward reads each logit once (JSD, the skew KLs and TVD: twice); the backward recomputes from per-row
statistics and writes dLoss/dzs. CPU and CUDA kernels.
nitrobrew.reference.logits holds the same definitions as plain PyTorch.
"""

from __future__ import annotations

from torch import Tensor

import torch

from nitrobrew import _checks, _divergences, distributed
from nitrobrew._divergences import divergence_functions
from nitrobrew._extension import kernel_device_types
from nitrobrew._reduction import reduce_rows
from nitrobrew._registration import ops, register_recompute_op, row_outputs
from nitrobrew.fused_linear import NUM_ROW_STATS
from nitrobrew.topk_linear import NUM_TOPK_ROW_STATS

__all__ = ["forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd", "topk_kl"]


def _fake_forward(zs, zt, labels, *options):
    torch._check(zs.dim() == 2 and zs.shape == zt.shape, lambda: "zs and zt must be [N, V] of one shape")
    return row_outputs(zs, zs.shape[0], NUM_ROW_STATS)


def _fake_topk_forward(zs, teacher_ids, teacher_logprobs, labels, *options):
    torch._check(zs.dim() == 2 and teacher_ids.dim() == 2, lambda: "zs must be [N, V] and teacher_ids [N, K]")
    # The row statistics, then the K student logits at the ids (as the ops from hidden states keep them).
    return row_outputs(zs, zs.shape[0], NUM_TOPK_ROW_STATS + teacher_ids.shape[1], dtype=torch.float64)


# logits_fwd(zs, zt, labels, *options), topk_logits_fwd(zs, teacher_ids, teacher_logprobs, labels, *options):
# the gradient flows to zs alone.
register_recompute_op("logits", n_tensors=3, differentiable=(0,), fake_forward=_fake_forward)
register_recompute_op("topk_logits", n_tensors=4, differentiable=(0,), fake_forward=_fake_topk_forward)

_KERNEL_DEVICE_TYPES = kernel_device_types("logits_fwd")


def _common_checks(zs, temperature, reduction, labels, ignore_index):
    """Checks shared by every loss here; returns (temperature, reduction, labels, ignore_index)."""
    _checks.kernel_device(zs.device, _KERNEL_DEVICE_TYPES)
    temperature = _checks.positive_number(temperature, "temperature")
    reduction = _checks.reduction(reduction)
    labels = _checks.labels(labels, zs.shape[:-1], zs.device, of="zs")
    return temperature, reduction, labels, _checks.ignore_index(ignore_index)


def _logits_loss(divergence: str, zs: Tensor, zt: Tensor, *, beta: float = 0.5, temperature: float = 1.0,
                 reduction: str = "mean", labels: Tensor | None = None, ignore_index: int = -100,
                 process_group=None) -> Tensor:
    """The one signature of every divergence from logits (beta: jsd's beta or the skew KLs' alpha,
    _divergences.py)."""
    for name, value in (("zs", zs), ("zt", zt)):
        _checks.tensor(value, name)
        _checks.floating(value, name)
    # A vocabulary shard may hold no columns (process_group=).
    if zs.dim() < 1 or zs.shape != zt.shape or (zs.shape[-1] == 0 and process_group is None):
        raise ValueError(f"zs and zt must be [..., V] logits of one shape (V >= 1), got {tuple(zs.shape)} and "
                         f"{tuple(zt.shape)}")
    if zs.dtype != zt.dtype:
        raise TypeError(f"zs and zt must share one dtype, got {zs.dtype} and {zt.dtype}")
    _checks.same_device({"zs": zs, "zt": zt})
    temperature, reduction, labels, ignore_index = _common_checks(zs, temperature, reduction, labels, ignore_index)
    beta = _checks.unit_interval(beta, "beta")
    lead_shape = zs.shape[:-1]
    flat_labels = labels.reshape(-1) if labels is not None else None
    vocab = zs.shape[-1]
    if process_group is not None:  # each rank holds a shard of the vocabulary: [..., V_shard]
        call = distributed.FusedLinearCall(divergence, beta, temperature, 0.0, None, None, 1.0, 1.0, ignore_index,
                                           None, 0)
        rows = lead_shape.numel()  # not -1: a shard may hold no columns
        loss = distributed.logits_loss(zs.reshape(rows, vocab), zt.reshape(rows, vocab), flat_labels, call,
                                       process_group)
        return reduce_rows(loss, lead_shape, reduction, flat_labels, ignore_index)
    loss, _ = ops.logits_fwd(zs.reshape(-1, vocab), zt.reshape(-1, vocab), flat_labels, ignore_index, divergence, beta,
                             temperature)
    return reduce_rows(loss, lead_shape, reduction, flat_labels, ignore_index)


_ARGUMENTS = """From logits the caller holds: s = zs / temperature, t = zt / temperature.

Args:
    zs, zt: [..., V] student and teacher logits of one shape and dtype (float32, float64, bfloat16 or
        float16). -inf entries have probability 0.
    beta (jsd only): the mixture weight, in [0, 1].
    alpha (skew_forward_kl and skew_reverse_kl only): the skew, in [0, 1].
    temperature: divides both models' logits.
    reduction: "none" (leading shape, masked rows 0), "sum", "mean" (over unmasked rows; 0 when none) or
        "batchmean" (= "mean").
    labels: int64, leading shape; rows whose label is ignore_index are masked.
    ignore_index: the label value of masked rows.
    process_group: a torch.distributed group over which the vocabulary is sharded (Megatron's
        vocabulary-parallel logits): zs, zt are this rank's [..., V_shard] columns, the ranks' shards
        contiguous in rank order; every rank gets the whole vocabulary's loss and zs.grad of its shard
        (nitrobrew.distributed).

Returns float32 (float64 for float64 inputs); the gradient flows to zs only.
"""

forward_kl, reverse_kl, jsd, skew_forward_kl, skew_reverse_kl, tvd = divergence_functions(
    _logits_loss, __name__, _ARGUMENTS)


def topk_kl(zs: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, *, normalize: str = "full",
            divergence: str = "forward_kl", beta: float | None = None, alpha: float | None = None,
            temperature: float = 1.0, reduction: str = "mean", labels: Tensor | None = None,
            ignore_index: int = -100, process_group=None) -> Tensor:
    """A divergence against a teacher's top-K log-probabilities (forward KL by default), from the student's
    logits zs: [..., V].

    teacher_ids: [..., K] int64, in [0, V), in any order; teacher_logprobs: [..., K] float, the teacher's
    log-probabilities (over its full vocabulary) of those tokens. Forward KL's loss per row is
    sum_k q_k (log q_k - log p_{id_k}) with q_k = exp(teacher_logprobs_k).
    normalize="full": p is the student's softmax over the whole vocabulary and q_k is used as given (its
    sum may be < 1); "topk": both are renormalized over the K ids. divergence, beta, alpha: as in
    nitrobrew.topk_kl (any of nitrobrew's divergences with "topk", forward KL with "full"). The temperature
    divides the student's logits only. Other options as in forward_kl (process_group: zs is this rank's
    [..., V_shard] columns and the teacher's ids stay global); the gradient flows to zs only. Masked rows' ids
    are not read (padding's -1 is fine there); with normalize="full" a row whose teacher mass sum_k q_k passes 1.25
    raises a ValueError; other ids outside [0, V) raise an IndexError naming the first one and its position (on
    CUDA at the cost of a host synchronization; skipped while torch.compile traces or a CUDA graph captures, where
    such a row's loss and gradient come out NaN instead).
    """
    _checks.tensor(zs, "zs")
    _checks.floating(zs, "zs")
    if zs.dim() < 1 or (zs.shape[-1] == 0 and process_group is None):
        raise ValueError(f"zs must be [..., V] logits with V >= 1, got {tuple(zs.shape)}")
    vocab = zs.shape[-1]
    _checks.topk_teacher(teacher_ids, teacher_logprobs, normalize, zs.shape[:-1],
                         vocab if process_group is None else None, of="zs")  # sharded: checked over all shards
    weight = _divergences.topk_weight(divergence, normalize, beta, alpha)
    k = teacher_ids.shape[-1]
    _checks.same_device({"zs": zs, "teacher_ids": teacher_ids, "teacher_logprobs": teacher_logprobs})
    temperature, reduction, labels, ignore_index = _common_checks(zs, temperature, reduction, labels, ignore_index)
    teacher_ids, teacher_logprobs = _checks.topk_rows(teacher_ids, teacher_logprobs, normalize, labels, ignore_index,
                                                      vocab if process_group is None else None)
    flat_labels = labels.reshape(-1) if labels is not None else None
    if process_group is not None:
        call = distributed.TopKCall(temperature, normalize == "topk", ignore_index, 1.0, 0, divergence, weight)
        loss = distributed.topk_logits_loss(zs.reshape(zs.shape[:-1].numel(), vocab), teacher_ids.reshape(-1, k),
                                            teacher_logprobs.reshape(-1, k), flat_labels, call, process_group)
        return reduce_rows(loss, zs.shape[:-1], reduction, flat_labels, ignore_index)
    loss, _ = ops.topk_logits_fwd(zs.reshape(-1, vocab), teacher_ids.reshape(-1, k), teacher_logprobs.reshape(-1, k),
                                  flat_labels, ignore_index, temperature, normalize == "topk", divergence, weight)
    return reduce_rows(loss, zs.shape[:-1], reduction, flat_labels, ignore_index)
