"""Distillation losses from logits the caller already holds.

For each row n of zs, zt: [..., V], with s = zs[n] / temperature, t = zt[n] / temperature,
p = softmax(s) (student) and q = softmax(t) (teacher):

    forward_kl:  KL(q || p)      reverse_kl:  KL(p || q)
    jsd(beta):   beta * KL(q || M) + (1 - beta) * KL(p || M),  M = (1 - beta) * p + beta * q

Entries of -inf (masked or padded vocabulary) have probability 0 and contribute 0 (0 log 0 = 0);
every row needs a finite logit in both models (on the CPU a row without one is an error; on CUDA its
loss and gradient are NaN, as a check would need a host synchronization). Only zs receives a
gradient. The forward reads each logit once (JSD: twice); the backward recomputes from per-row
statistics and writes dLoss/dzs. CPU and CUDA kernels.
nitrobrew.reference.logit_distill holds the same definitions as plain PyTorch.
"""

from __future__ import annotations

from torch import Tensor

from nitrobrew import _checks
from nitrobrew._extension import kernel_device_types
from nitrobrew._reduction import reduce_rows
from nitrobrew.ops import logit_distill, topk_logit_distill

__all__ = ["forward_kl", "reverse_kl", "jsd", "topk_kl"]

_KERNEL_DEVICE_TYPES = kernel_device_types()


def _common_checks(zs, temperature, reduction, labels, ignore_index):
    """Checks shared by every loss here; returns (temperature, reduction, labels)."""
    _checks.kernel_device(zs.device, _KERNEL_DEVICE_TYPES)
    temperature = _checks.positive_number(temperature, "temperature")
    reduction = _checks.reduction(reduction)
    labels = _checks.labels(labels, zs.shape[:-1], zs.device, of="zs")
    _checks.ignore_index(ignore_index)
    return temperature, reduction, labels


def _logit_loss(zs, zt, *, beta, temperature, reduction, labels, ignore_index) -> Tensor:
    for name, value in (("zs", zs), ("zt", zt)):
        _checks.tensor(value, name)
        _checks.floating(value, name)
    if zs.dim() < 1 or zs.shape != zt.shape or zs.shape[-1] == 0:
        raise ValueError(f"zs and zt must be [..., V] logits of one shape (V >= 1), got {tuple(zs.shape)} and "
                         f"{tuple(zt.shape)}")
    if zs.dtype != zt.dtype:
        raise TypeError(f"zs and zt must share one dtype, got {zs.dtype} and {zt.dtype}")
    _checks.same_device({"zs": zs, "zt": zt})
    temperature, reduction, labels = _common_checks(zs, temperature, reduction, labels, ignore_index)
    beta = _checks.unit_interval(beta, "beta")
    lead_shape = zs.shape[:-1]
    flat_labels = labels.reshape(-1) if labels is not None else None
    vocab = zs.shape[-1]
    loss = logit_distill(zs.reshape(-1, vocab), zt.reshape(-1, vocab), flat_labels, ignore_index=ignore_index,
                         beta=beta, temperature=temperature)
    return reduce_rows(loss, lead_shape, reduction, flat_labels, ignore_index)


def forward_kl(zs: Tensor, zt: Tensor, *, temperature: float = 1.0, reduction: str = "mean",
               labels: Tensor | None = None, ignore_index: int = -100) -> Tensor:
    """Forward KL(teacher || student) per row of zs, zt: [..., V] (float32, float64, bf16 or fp16).

    reduction: "none" (leading shape, masked rows 0), "sum", "mean" (over unmasked rows; 0 when none) or
    "batchmean" (= "mean"). labels: int64, leading shape; rows whose label is ignore_index are masked.
    Returns float32 (float64 for float64 inputs); the gradient flows to zs only.
    """
    return _logit_loss(zs, zt, beta=0.0, temperature=temperature, reduction=reduction, labels=labels,
                       ignore_index=ignore_index)


def reverse_kl(zs: Tensor, zt: Tensor, *, temperature: float = 1.0, reduction: str = "mean",
               labels: Tensor | None = None, ignore_index: int = -100) -> Tensor:
    """Reverse KL(student || teacher) per row; arguments as in forward_kl."""
    return _logit_loss(zs, zt, beta=1.0, temperature=temperature, reduction=reduction, labels=labels,
                       ignore_index=ignore_index)


def jsd(zs: Tensor, zt: Tensor, *, beta: float = 0.5, temperature: float = 1.0, reduction: str = "mean",
        labels: Tensor | None = None, ignore_index: int = -100) -> Tensor:
    """Generalized JSD(beta) per row (beta = 0: forward KL, 1: reverse KL); arguments as in forward_kl."""
    return _logit_loss(zs, zt, beta=beta, temperature=temperature, reduction=reduction, labels=labels,
                       ignore_index=ignore_index)


def topk_kl(zs: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, *, normalize: str = "full",
            temperature: float = 1.0, reduction: str = "mean", labels: Tensor | None = None,
            ignore_index: int = -100) -> Tensor:
    """Forward KL against a teacher's top-K log-probabilities, from the student's logits zs: [..., V].

    teacher_ids: [..., K] int64, in [0, V), in any order; teacher_logprobs: [..., K] float, the teacher's
    log-probabilities (over its full vocabulary) of those tokens. The loss per row is
    sum_k q_k (log q_k - log p_{id_k}) with q_k = exp(teacher_logprobs_k).
    normalize="full": p is the student's softmax over the whole vocabulary and q_k is used as given (its
    sum may be < 1); "topk": both are renormalized over the K ids. The temperature divides the student's
    logits only. Other options as in forward_kl; the gradient flows to zs only. On CUDA, ids outside
    [0, V) stop the kernel with a device-side assertion (as torch.gather's do); the CPU raises.
    """
    _checks.tensor(zs, "zs")
    _checks.floating(zs, "zs")
    if zs.dim() < 1 or zs.shape[-1] == 0:
        raise ValueError(f"zs must be [..., V] logits with V >= 1, got {tuple(zs.shape)}")
    vocab = zs.shape[-1]
    _checks.topk_teacher(teacher_ids, teacher_logprobs, normalize, zs.shape[:-1], vocab, of="zs")
    k = teacher_ids.shape[-1]
    _checks.same_device({"zs": zs, "teacher_ids": teacher_ids, "teacher_logprobs": teacher_logprobs})
    temperature, reduction, labels = _common_checks(zs, temperature, reduction, labels, ignore_index)
    flat_labels = labels.reshape(-1) if labels is not None else None
    loss = topk_logit_distill(zs.reshape(-1, vocab), teacher_ids.reshape(-1, k), teacher_logprobs.reshape(-1, k),
                              flat_labels, ignore_index=ignore_index, temperature=temperature,
                              renormalize=normalize == "topk")
    return reduce_rows(loss, zs.shape[:-1], reduction, flat_labels, ignore_index)
