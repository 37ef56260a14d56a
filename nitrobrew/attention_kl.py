"""KL between attention distributions, softmax(scale * q . k^T / temperature) of a student and a
teacher, computed per query row without materializing the [queries x keys] matrix.

    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True)                  # [B, N, H, D]
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, layout="bhnd")   # [B, H, N, D]

Layouts: "bnhd" (the default) takes FlashAttention's [B, N, H, D] tensors; "bhnd" takes [B, H, N, D]
ones, as Hugging Face attention modules and scaled_dot_product_attention hold them. A "bhnd" tensor is
read where it lies (a transposed view, no copy) when its head dim is contiguous and, on CUDA with
16-bit inputs, a multiple of 8 with 16-byte aligned rows; otherwise it is copied once, as any other
input the kernels cannot read in place. Gradients come back in the layout of the inputs.

Kernels: CPU (C++, any float dtype) and CUDA: bfloat16 / float16 on tensor cores (sm_80 and newer;
head dims up to 256), and float32 through a chunked path of exact float32 GEMMs (TF32 off for the
call, whatever the global setting; blocks of query rows whose scores stay within a fixed memory
budget), correct to float32 precision and several times slower than the 16-bit kernels.
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
# The public `layout` and how its tensors' shapes read.
_LAYOUTS = {"bnhd": "[B, N, H, D]", "bhnd": "[B, H, N, D]"}
_CUDA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _in_layout(layout: str, n: str, h: str, d: str) -> str:
    """A shape named in the layout's own order, e.g. '[B, N_q, H, D_s]' or '[B, H, N_q, D_s]'."""
    return f"[B, {n}, {h}, {d}]" if layout == "bnhd" else f"[B, {h}, {n}, {d}]"


def _check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'bnhd' ([B, N, H, D], FlashAttention's) or 'bhnd' ([B, H, N, D], "
                         f"Hugging Face's and scaled_dot_product_attention's), got {layout!r}")
    return layout


def _as_bnhd(t: Tensor, layout: str) -> Tensor:
    """The [B, N, H, D] view of an input given in `layout` (no copy)."""
    return t if layout == "bnhd" else t.transpose(1, 2)


def _check_shapes(given: dict, views: dict, layout: str) -> None:
    """The four inputs' shapes against each other, named in the layout's own terms. `views` are their
    [B, N, H, D] views, `given` the tensors as passed."""
    q_s, k_s, q_t, k_t = (views[name] for name in ("q_s", "k_s", "q_t", "k_t"))
    shapes = {name: tuple(t.shape) for name, t in given.items()}
    if len({t.shape[0] for t in views.values()}) != 1:
        raise ValueError(f"q_s, k_s, q_t, k_t must have the same batch size B, got shapes {shapes}")
    batch, n_queries, heads, dim_s = q_s.shape
    if q_t.shape[1] != n_queries or q_t.shape[2] != heads:
        raise ValueError(f"q_t must be {_in_layout(layout, 'N_q', 'H', 'D_t')} with q_s's N_q = {n_queries} and "
                         f"H = {heads} (layout={layout!r}), got {shapes['q_t']}")
    if k_t.shape[1] != k_s.shape[1]:
        raise ValueError(f"k_s and k_t must have the same number of keys N_k, got {k_s.shape[1]} and "
                         f"{k_t.shape[1]} (shapes {shapes['k_s']} and {shapes['k_t']}, layout={layout!r})")
    for k, q, who in ((k_s, q_s, "s"), (k_t, q_t, "t")):
        if k.shape[3] != q.shape[3]:
            raise ValueError(f"k_{who}'s head dim D_{who} ({k.shape[3]}) differs from q_{who}'s ({q.shape[3]})")
        if k.shape[2] == 0 or heads % k.shape[2] != 0:
            model = "student" if who == "s" else "teacher"
            raise ValueError(f"the {model}'s query heads H ({heads}) must be a multiple of its key heads H_k{who} "
                             f"({k.shape[2]}): k_{who} is {_in_layout(layout, 'N_k', f'H_k{who}', f'D_{who}')}, "
                             f"got {shapes['k_' + who]}")


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
    layout: str = "bnhd",
) -> Tensor:
    """KL between the student's and the teacher's attention distributions, per query row.

    Args:
        q_s, k_s: the student's queries [B, N_q, H, D_s] and keys [B, N_k, H_ks, D_s]
            (FlashAttention's layout; GQA: H a multiple of H_ks). Gradients flow to these.
            With layout="bhnd": [B, H, N_q, D_s] and [B, H_ks, N_k, D_s].
        q_t, k_t: the teacher's, [B, N_q, H, D_t] and [B, N_k, H_kt, D_t] (layout="bhnd":
            [B, H, N_q, D_t] and [B, H_kt, N_k, D_t]); no gradient.
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
            default backward's time). The CPU kernel and CUDA's float32 path are reproducible
            either way.
        layout: "bnhd" ([B, N, H, D], the default) or "bhnd" ([B, H, N, D], read in place where
            the kernels can: see the module's docstring). The loss ("none": [B, H, N_q]) is the same
            either way; gradients have the inputs' shapes.
    """
    layout = _check_layout(layout)
    given = {"q_s": q_s, "k_s": k_s, "q_t": q_t, "k_t": k_t}
    for name, value in given.items():
        _checks.tensor(value, name)
        _checks.floating(value, name)
        if value.dim() != 4:
            raise ValueError(f"{name} must be {_LAYOUTS[layout]} (layout={layout!r}), got shape {tuple(value.shape)}")
        if value.shape[-1] == 0:
            raise ValueError(f"{name} must have a head dim D >= 1 (its last dimension), got shape {tuple(value.shape)}")
    _checks.same_device(given)
    views = {name: _as_bnhd(value, layout) for name, value in given.items()}
    _check_shapes(given, views, layout)
    q_s, k_s, q_t, k_t = (views[name] for name in ("q_s", "k_s", "q_t", "k_t"))
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
    if q_s.device.type == "cuda" and q_s.dtype not in _CUDA_DTYPES:
        raise TypeError(f"nitrobrew.attention_kl on CUDA takes bfloat16 or float16 inputs (tensor cores, as "
                        f"FlashAttention) or float32 ones (exact, slower), got {q_s.dtype}; cast q and k, e.g. "
                        f"q.to(torch.bfloat16), or use the CPU for float64")
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
