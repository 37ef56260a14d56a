"""Reference implementations: the definitions of nitrobrew's losses written as plain
PyTorch that materializes the [tokens x vocab] logits. For tests and benchmarks only;
evaluate them in float64 to get an oracle."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _softcap(z: Tensor, cap: float | None) -> Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def divergence_from_logits(s: Tensor, t: Tensor, beta: float) -> Tensor:
    """Per-row divergence between p = softmax(s) (student) and q = softmax(t) (teacher):
    beta = 0 forward KL(q||p), beta = 1 reverse KL(p||q), otherwise generalized JSD(beta)."""
    log_p = torch.log_softmax(s, dim=-1)
    log_q = torch.log_softmax(t, dim=-1)
    if beta == 0.0:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if beta == 1.0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    log_m = torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))
    kl_q_m = (log_q.exp() * (log_q - log_m)).sum(-1)
    kl_p_m = (log_p.exp() * (log_p - log_m)).sum(-1)
    return beta * kl_q_m + (1.0 - beta) * kl_p_m


def fused_linear_distill(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: Tensor | None = None,
    ignore_index: int = -100,
    ce_weight: float = 0.0,
    softcap_s: float | None = None,
    softcap_t: float | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """What nitrobrew.forward_kl (beta=0), reverse_kl (beta=1) and jsd(beta) compute, with the
    logits materialized in `dtype` (None: the inputs' dtype, as naive PyTorch would)."""
    if dtype is not None:
        xs, xt, ws, wt = (t.to(dtype) for t in (xs, xt, ws, wt))
    vocab_size = ws.shape[0] if vocab_size is None else vocab_size
    zs = _softcap(xs @ ws[:vocab_size].T, softcap_s)  # [..., V]
    zt = _softcap(xt @ wt[:vocab_size].T, softcap_t)
    loss = divergence_from_logits(zs / temperature, zt / temperature, beta)
    mask = torch.ones_like(loss, dtype=torch.bool) if labels is None else labels != ignore_index
    if ce_weight != 0.0:
        safe_labels = torch.where(mask, labels, torch.zeros_like(labels))
        ce = torch.logsumexp(zs, -1) - zs.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
        loss = loss + ce_weight * ce
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / mask.sum().clamp(min=1)
