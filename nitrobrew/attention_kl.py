"""KL between attention distributions, softmax(scale * q . k^T / temperature) of a student and a
teacher, computed per query row without materializing the [queries x keys] matrix.

    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True)

Kernels: CPU (C++, any float dtype) and CUDA (bfloat16 / float16 on tensor cores, sm_80 and newer;
head dims up to 256).
"""

from __future__ import annotations

import torch
from torch import Tensor

from nitrobrew import _checks
from nitrobrew._extension import kernel_device_types
from nitrobrew._registration import ops, register_recompute_op, stats_dtype

__all__ = ["attention_kl"]

# Columns of the forward's per-row statistics (kNumAttentionRowStats in
# csrc/attention_kl/attention_kl_params.h).
NUM_ATTENTION_ROW_STATS = 5


def _fake_forward(q_s, k_s, q_t, k_t, key_mask, *options):
    torch._check(q_s.dim() == 4 and k_s.dim() == 4 and q_t.dim() == 4 and k_t.dim() == 4,
                 lambda: "attention_kl: inputs must be [B, N, H, D]")
    b, n_q, h, _ = q_s.shape
    dtype = stats_dtype(q_s.dtype)
    return (q_s.new_empty((b, h, n_q), dtype=dtype),
            q_s.new_empty((b, h, n_q, NUM_ATTENTION_ROW_STATS), dtype=dtype))


# attention_kl_fwd(q_s, k_s, q_t, k_t, key_mask, *options); gradients to the student's q_s and k_s.
register_recompute_op("attention_kl", n_tensors=5, differentiable=(0, 1), fake_forward=_fake_forward)

_KERNEL_DEVICE_TYPES = kernel_device_types("attention_kl_fwd")
# The public `kind` and the op's divergence.
_DIVERGENCES = {"forward": "forward_kl", "reverse": "reverse_kl"}


def _rows_seeing_a_key(batch: int, n_queries: int, n_keys: int, causal: bool, attention_mask: Tensor | None,
                       device) -> Tensor:
    """[B, N_q] bool: the (batch, query) rows that see at least one key."""
    if causal:  # query i sees keys j <= i + N_k - N_q
        last = torch.arange(n_queries, device=device) + (n_keys - n_queries)
    else:
        last = torch.full((n_queries,), n_keys - 1, device=device)
    sees = (last >= 0).expand(batch, n_queries)
    if attention_mask is None or n_keys == 0:
        return sees
    seen = attention_mask.to(torch.int32).cumsum(dim=1)  # [B, N_k]: attended keys among 0..j
    return sees & (seen.gather(1, last.clamp(0, n_keys - 1).expand(batch, -1)) > 0)


def _mask(value, name: str, shape: tuple, device) -> Tensor | None:
    """A [B, N] mask, bool or integer 0/1 (Hugging Face's int64 attention_mask), as bool: nonzero = kept."""
    if value is None:
        return None
    _checks.tensor(value, name)
    if value.is_floating_point() or value.is_complex():
        raise TypeError(f"{name} must be a bool or integer tensor (nonzero = kept), got {value.dtype}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must be [B, N] = {list(shape)}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device}, got {value.device}")
    return value if value.dtype == torch.bool else value != 0


def attention_kl(
    q_s: Tensor,
    k_s: Tensor,
    q_t: Tensor,
    k_t: Tensor,
    *,
    kind: str = "forward",
    causal: bool = False,
    scale_s: float | None = None,
    scale_t: float | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
    attention_mask: Tensor | None = None,
    query_mask: Tensor | None = None,
    deterministic: bool = False,
) -> Tensor:
    """KL between the student's and the teacher's attention distributions, per query row.

    Args:
        q_s, k_s: the student's queries [B, N_q, H, D_s] and keys [B, N_k, H_ks, D_s]
            (FlashAttention's layout; GQA: H a multiple of H_ks). Gradients flow to these.
        q_t, k_t: the teacher's, [B, N_q, H, D_t] and [B, N_k, H_kt, D_t]; no gradient.
        kind: "forward" = KL(teacher || student), "reverse" = KL(student || teacher).
        causal: query i sees keys j <= i + N_k - N_q (aligned bottom-right, as FlashAttention).
        scale_s, scale_t: score scales, default 1/sqrt(D) of each model. Scores are
            scale * q . k / temperature.
        reduction: "none" -> [B, H, N_q]; "sum"; "mean" over the rows that see at least one key (and
            that query_mask keeps). Rows that see no key give 0 and zero gradient.
        attention_mask: [B, N_k] bool or integer 0/1, nonzero = the key is attended (Hugging Face's
            convention; its int64 attention_mask works as it is).
        query_mask: [B, N_q] bool or integer 0/1, nonzero = the query row counts: padded query rows
            give 0 and zero gradient and are left out of "mean". (Often the same tensor as
            attention_mask, when N_q = N_k.)
        deterministic: CUDA: accumulate dq without floating-point atomics, so gradients are
            bitwise reproducible (it recomputes the scores once more; on Hopper 2-3 times the
            default backward's time). The CPU kernel is reproducible either way.
    """
    for name, value in (("q_s", q_s), ("k_s", k_s), ("q_t", q_t), ("k_t", k_t)):
        _checks.tensor(value, name)
        _checks.floating(value, name)
        if value.dim() != 4:
            raise ValueError(f"{name} must be [B, N, H, D], got shape {tuple(value.shape)}")
        if value.shape[-1] == 0:
            raise ValueError(f"{name} must have a head dim D >= 1 (its last dimension), got shape {tuple(value.shape)}")
    _checks.same_device({"q_s": q_s, "k_s": k_s, "q_t": q_t, "k_t": k_t})
    if kind not in _DIVERGENCES:
        raise ValueError(f"kind must be 'forward' or 'reverse', got {kind!r}")
    if not isinstance(causal, bool) or not isinstance(deterministic, bool):
        raise TypeError("causal and deterministic must be bools")
    temperature = _checks.positive_number(temperature, "temperature")
    reduction = _checks.reduction(reduction)
    scale_s = q_s.shape[-1] ** -0.5 if scale_s is None else _checks.positive_number(scale_s, "scale_s")
    scale_t = q_t.shape[-1] ** -0.5 if scale_t is None else _checks.positive_number(scale_t, "scale_t")
    batch, n_queries, heads, _ = q_s.shape
    n_keys = k_s.shape[1]
    attention_mask = _mask(attention_mask, "attention_mask", (batch, n_keys), q_s.device)
    query_mask = _mask(query_mask, "query_mask", (batch, n_queries), q_s.device)
    if q_s.device.type not in _KERNEL_DEVICE_TYPES and q_s.device.type != "meta":
        raise NotImplementedError(
            f"nitrobrew.attention_kl has no {q_s.device.type} kernels; move the tensors to the CPU or use "
            f"nitrobrew.reference.attention_kl, which materializes the scores"
        )
    if q_s.device.type == "cuda" and q_s.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"nitrobrew.attention_kl's CUDA kernels take bfloat16 or float16 inputs (tensor cores, as "
                        f"FlashAttention), got {q_s.dtype}; cast q and k, e.g. q.to(torch.bfloat16)")
    loss, _ = ops.attention_kl_fwd(q_s, k_s, q_t, k_t, attention_mask, _DIVERGENCES[kind], causal, scale_s, scale_t,
                                   temperature, deterministic)
    if query_mask is not None:  # the gradient of a dropped row is 0: its backward contributes nothing
        loss = torch.where(query_mask[:, None, :], loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    rows = _rows_seeing_a_key(batch, n_queries, n_keys, causal, attention_mask, q_s.device)
    if query_mask is not None:
        rows = rows & query_mask
    return loss.sum() / (rows.sum() * heads).clamp(min=1)
