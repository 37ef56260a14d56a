"""Distillation losses computed from hidden states and unembedding matrices.

For each token n, with student logits s = softcap_s(xs[n] @ ws.T) / temperature and teacher
logits t = softcap_t(xt[n] @ wt.T) / temperature over the first `vocab_size` rows of the
weights, p = softmax(s) (student) and q = softmax(t) (teacher):

    forward_kl:  KL(q || p) = sum(q * (log q - log p))
    reverse_kl:  KL(p || q) = sum(p * (log p - log q))
    jsd(beta):   beta * KL(q || M) + (1 - beta) * KL(p || M),  M = (1 - beta) * p + beta * q
                 (beta = 0 is forward_kl, beta = 1 is reverse_kl)

plus, with ce_weight > 0, ce_weight * cross_entropy(softcap_s(xs[n] @ ws.T), labels[n]) at
temperature 1. The [tokens x vocab] logits are never written to memory: the kernels tile the
vocabulary, reduce each tile into per-token running statistics and recompute the tiles in the
backward pass. nitrobrew.reference holds the same definitions as plain (materializing) PyTorch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nitrobrew import _checks
from nitrobrew._extension import kernel_device_types
from nitrobrew._reduction import reduce_rows
from nitrobrew.ops import fused_linear_distill

__all__ = ["forward_kl", "reverse_kl", "jsd"]

# Read once at import: torch.compile cannot trace the dispatcher query itself.
_KERNEL_DEVICE_TYPES = kernel_device_types()


def autocast_inputs(*tensors):
    """Under torch.autocast, compute in its dtype, as the lm_head matmuls it replaces would."""
    device_type = tensors[0].device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


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
    xs, xt, ws, wt, *, beta, temperature, reduction, labels, ignore_index, chunk_V, ce_weight, softcap_s,
    softcap_t, vocab_size,
) -> Tensor:
    for name, value in (("xs", xs), ("xt", xt), ("ws", ws), ("wt", wt)):
        _checks.tensor(value, name)
        _checks.floating(value, name)
    if xs.dim() < 1 or xt.dim() < 1:
        raise ValueError(f"xs and xt must be [..., D] tensors, got shapes {tuple(xs.shape)} and {tuple(xt.shape)}")
    if ws.dim() != 2 or wt.dim() != 2:
        raise ValueError(f"ws and wt must be [V, D] matrices, got shapes {tuple(ws.shape)} and {tuple(wt.shape)}")
    lead_shape = xs.shape[:-1]
    if xt.shape[:-1] != lead_shape:
        raise ValueError(
            f"xs and xt must have the same leading shape, got {tuple(xs.shape)} and {tuple(xt.shape)}"
        )
    if ws.shape[1] != xs.shape[-1]:
        raise ValueError(f"ws must be [V, D_s] with D_s = xs.shape[-1] = {xs.shape[-1]}, got {tuple(ws.shape)}")
    if wt.shape[1] != xt.shape[-1]:
        raise ValueError(f"wt must be [V, D_t] with D_t = xt.shape[-1] = {xt.shape[-1]}, got {tuple(wt.shape)}")
    _checks.same_device({"xs": xs, "xt": xt, "ws": ws, "wt": wt})
    xs, xt, ws, wt = autocast_inputs(xs, xt, ws, wt)
    if ws.dtype != xs.dtype or wt.dtype != xt.dtype or xt.dtype != xs.dtype:
        mismatch = "xs and ws" if ws.dtype != xs.dtype else "xt and wt" if wt.dtype != xt.dtype else "student and teacher"
        raise TypeError(
            f"xs, xt, ws and wt must share one dtype ({mismatch} differ): got xs {xs.dtype}, xt {xt.dtype}, "
            f"ws {ws.dtype}, wt {wt.dtype}. Cast them to one dtype, or call under torch.autocast, which casts "
            f"all four to its dtype"
        )
    _checks.kernel_device(xs.device, _KERNEL_DEVICE_TYPES)
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
    vocab_size = _resolve_vocab_size(ws, wt, vocab_size)

    flat_labels = labels.reshape(-1) if labels is not None else None
    loss = fused_linear_distill(
        xs.reshape(-1, xs.shape[-1]),
        xt.reshape(-1, xt.shape[-1]),
        ws,
        wt,
        flat_labels,
        ignore_index=ignore_index,
        beta=beta,
        temperature=temperature,
        ce_weight=ce_weight,
        softcap_s=softcap_s,
        softcap_t=softcap_t,
        vocab_size=vocab_size,
        chunk_v=chunk_V or 0,
    )
    return reduce_rows(loss, lead_shape, reduction, flat_labels, ignore_index)


def forward_kl(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: Tensor | None = None,
    ignore_index: int = -100,
    chunk_V: int | None = None,
    ce_weight: float = 0.0,
    softcap_s: float | None = None,
    softcap_t: float | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Forward KL(teacher || student) per token, from hidden states and unembeddings.

    Args:
        xs: [..., D_s] student hidden states. xt: [..., D_t] teacher hidden states, same leading shape.
        ws: [V, D_s] student unembedding. wt: [V, D_t] teacher unembedding (no gradient).
        temperature: divides both models' (soft-capped) logits.
        reduction: "none" (leading shape of xs, masked tokens 0), "sum", "mean" (sum over unmasked
            tokens / their number, 0 when none) or "batchmean" (= "mean").
        labels: int64, leading shape of xs; tokens whose label is ignore_index are masked.
        chunk_V: vocabulary tile width of the CPU kernel (None = automatic).
        ce_weight: adds ce_weight * cross-entropy of the student's temperature-1 logits at labels.
        softcap_s, softcap_t: Gemma-style cap c * tanh(z / c) per model, before the temperature.
        vocab_size: real vocabulary entries when ws / wt are padded; rows past it are excluded.

    Returns the loss in float32 (float64 for float64 inputs). Gradients flow to xs and ws.
    """
    return _fused_linear_loss(
        xs, xt, ws, wt, beta=0.0, temperature=temperature, reduction=reduction, labels=labels,
        ignore_index=ignore_index, chunk_V=chunk_V, ce_weight=ce_weight, softcap_s=softcap_s,
        softcap_t=softcap_t, vocab_size=vocab_size,
    )


def reverse_kl(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: Tensor | None = None,
    ignore_index: int = -100,
    chunk_V: int | None = None,
    ce_weight: float = 0.0,
    softcap_s: float | None = None,
    softcap_t: float | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Reverse KL(student || teacher) per token; arguments as in forward_kl."""
    return _fused_linear_loss(
        xs, xt, ws, wt, beta=1.0, temperature=temperature, reduction=reduction, labels=labels,
        ignore_index=ignore_index, chunk_V=chunk_V, ce_weight=ce_weight, softcap_s=softcap_s,
        softcap_t=softcap_t, vocab_size=vocab_size,
    )


def jsd(
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
) -> Tensor:
    """Generalized Jensen-Shannon divergence beta * KL(q || M) + (1 - beta) * KL(p || M) with
    M = (1 - beta) p + beta q (TRL / Liger convention: beta = 0 is forward KL, beta = 1 reverse KL);
    other arguments as in forward_kl."""
    return _fused_linear_loss(
        xs, xt, ws, wt, beta=beta, temperature=temperature, reduction=reduction, labels=labels,
        ignore_index=ignore_index, chunk_V=chunk_V, ce_weight=ce_weight, softcap_s=softcap_s,
        softcap_t=softcap_t, vocab_size=vocab_size,
    )
