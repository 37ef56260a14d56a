"""The per-token losses' reductions, shared by the public loss functions."""

from __future__ import annotations

from torch import Tensor


def reduce_rows(loss: Tensor, lead_shape, reduction: str, flat_labels: Tensor | None, ignore_index: int) -> Tensor:
    """loss: [N] per token (masked tokens 0). "none" restores the leading shape; "mean" divides by the
    number of unmasked tokens (0 when there are none)."""
    if reduction == "none":
        return loss.reshape(lead_shape)
    if reduction == "sum":
        return loss.sum()
    if flat_labels is None:
        return loss.sum() / max(loss.shape[0], 1)
    return loss.sum() / (flat_labels != ignore_index).sum().clamp(min=1)
