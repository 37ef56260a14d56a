"""The private torch.library operators: fake (meta) implementations and autograd.

The schemas live in csrc/registration.cpp and the kernels in csrc/cpu and csrc/cuda;
this module adds what torch.compile and autograd need. Callers use the documented
functions in nitrobrew.fused_linear.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nitrobrew._extension import load_extension

load_extension()

_ops = torch.ops.nitrobrew

# Columns of the forward's per-row statistics (RowStat in csrc/fused_linear_params.h).
NUM_ROW_STATS = 7


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-row losses and statistics are float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("nitrobrew::fused_linear_distill_fwd")
def _fused_linear_distill_fwd_fake(
    xs, xt, ws, wt, labels, ignore_index, beta, temperature, ce_weight, softcap_s, softcap_t, vocab_size, chunk_v
):
    torch._check(xs.dim() == 2 and xt.dim() == 2, lambda: "xs and xt must be 2-D")
    torch._check(ws.dim() == 2 and wt.dim() == 2, lambda: "ws and wt must be 2-D")
    torch._check(xs.shape[0] == xt.shape[0], lambda: "xs and xt must have the same number of rows")
    torch._check(ws.shape[1] == xs.shape[1], lambda: "ws must be [V, D_s]")
    torch._check(wt.shape[1] == xt.shape[1], lambda: "wt must be [V, D_t]")
    n = xs.shape[0]
    dtype = _stats_dtype(xs.dtype)
    return xs.new_empty((n,), dtype=dtype), xs.new_empty((n, NUM_ROW_STATS), dtype=dtype)


@torch.library.register_fake("nitrobrew::fused_linear_distill_bwd")
def _fused_linear_distill_bwd_fake(
    grad_loss, xs, xt, ws, wt, labels, row_stats, ignore_index, beta, temperature,
    ce_weight, softcap_s, softcap_t, vocab_size, chunk_v, compute_dxs, compute_dws,
):
    torch._check(grad_loss.shape == (xs.shape[0],), lambda: "grad_loss must be [N]")
    dxs = torch.empty_like(xs, memory_format=torch.contiguous_format) if compute_dxs else xs.new_empty((0,))
    dws = torch.empty_like(ws, memory_format=torch.contiguous_format) if compute_dws else ws.new_empty((0,))
    return dxs, dws


def _save_for_recompute(ctx, inputs, output, n_tensors):
    """setup_context of the forward ops: saves the first n_tensors inputs and the row statistics
    (the backward recomputes from them); the remaining inputs are plain options.

    Tensors made under torch.inference_mode (a teacher's logits or hidden states, typically) cannot go
    through save_for_backward; they are held on ctx as they are instead of being copied (for logits
    that copy would be [N x V]). They cannot be modified in place outside inference mode, so there is
    no version to check. (torch.compile cannot ask is_inference(); Dynamo treats such inputs itself.)"""
    _, row_stats = output
    tensors = (*inputs[:n_tensors], row_stats)
    held = {}
    if not torch.compiler.is_compiling():
        held = {i: t for i, t in enumerate(tensors) if isinstance(t, Tensor) and t.is_inference()}
    ctx.save_for_backward(*(None if i in held else t for i, t in enumerate(tensors)))
    ctx.held_inference_tensors = held
    ctx.options = inputs[n_tensors:]
    ctx.mark_non_differentiable(row_stats)


def _saved(ctx):
    """The tensors _save_for_recompute saved, in their order."""
    held = ctx.held_inference_tensors
    return tuple(held.get(i, t) for i, t in enumerate(ctx.saved_tensors))


def _forbid_double_backward():
    if torch.is_grad_enabled():
        raise RuntimeError("nitrobrew's fused losses support one backward pass; double backward "
                           "(create_graph=True) is not implemented")


def _setup_context(ctx, inputs, output):
    # Options: ignore_index, beta, temperature, ce_weight, softcaps, vocab_size, chunk_v.
    _save_for_recompute(ctx, inputs, output, n_tensors=5)  # xs, xt, ws, wt, labels


def _backward(ctx, grad_loss, _grad_row_stats):
    _forbid_double_backward()
    xs, xt, ws, wt, labels, row_stats = _saved(ctx)
    need_dxs, need_dws = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if not (need_dxs or need_dws):
        return (None,) * 13
    dxs, dws = _ops.fused_linear_distill_bwd(
        grad_loss, xs, xt, ws, wt, labels, row_stats, *ctx.options, need_dxs, need_dws
    )
    # The teacher's tensors (xt, wt), labels and options receive no gradient.
    return (dxs if need_dxs else None, None, dws if need_dws else None) + (None,) * 10


torch.library.register_autograd("nitrobrew::fused_linear_distill_fwd", _backward, setup_context=_setup_context)


@torch.library.register_fake("nitrobrew::logit_distill_fwd")
def _logit_distill_fwd_fake(zs, zt, labels, ignore_index, beta, temperature):
    torch._check(zs.dim() == 2 and zs.shape == zt.shape, lambda: "zs and zt must be [N, V] of one shape")
    n = zs.shape[0]
    dtype = _stats_dtype(zs.dtype)
    return zs.new_empty((n,), dtype=dtype), zs.new_empty((n, NUM_ROW_STATS), dtype=dtype)


@torch.library.register_fake("nitrobrew::logit_distill_bwd")
def _logit_distill_bwd_fake(grad_loss, zs, zt, labels, row_stats, ignore_index, beta, temperature):
    torch._check(grad_loss.shape == (zs.shape[0],), lambda: "grad_loss must be [N]")
    return torch.empty_like(zs, memory_format=torch.contiguous_format)


def _logit_setup_context(ctx, inputs, output):
    # Options: ignore_index, beta, temperature.
    _save_for_recompute(ctx, inputs, output, n_tensors=3)  # zs, zt, labels


def _logit_backward(ctx, grad_loss, _grad_row_stats):
    _forbid_double_backward()
    zs, zt, labels, row_stats = _saved(ctx)
    if not ctx.needs_input_grad[0]:
        return (None,) * 6
    dzs = _ops.logit_distill_bwd(grad_loss, zs, zt, labels, row_stats, *ctx.options)
    return (dzs,) + (None,) * 5  # the teacher's logits, labels and options receive no gradient


torch.library.register_autograd("nitrobrew::logit_distill_fwd", _logit_backward, setup_context=_logit_setup_context)


NUM_TOPK_ROW_STATS = 4  # kNumTopKRowStats in csrc/topk_params.h


@torch.library.register_fake("nitrobrew::topk_logit_distill_fwd")
def _topk_logit_distill_fwd_fake(zs, teacher_ids, teacher_logprobs, labels, ignore_index, temperature, renormalize):
    torch._check(zs.dim() == 2 and teacher_ids.dim() == 2, lambda: "zs must be [N, V] and teacher_ids [N, K]")
    n, k = zs.shape[0], teacher_ids.shape[1]
    # The row statistics, then the K student logits at the ids (as the ops from hidden states keep them).
    return (zs.new_empty((n,), dtype=_stats_dtype(zs.dtype)),
            zs.new_empty((n, NUM_TOPK_ROW_STATS + k), dtype=torch.float64))


@torch.library.register_fake("nitrobrew::topk_logit_distill_bwd")
def _topk_logit_distill_bwd_fake(grad_loss, zs, teacher_ids, teacher_logprobs, labels, row_stats, ignore_index,
                                 temperature, renormalize):
    torch._check(grad_loss.shape == (zs.shape[0],), lambda: "grad_loss must be [N]")
    return torch.empty_like(zs, memory_format=torch.contiguous_format)


def _topk_setup_context(ctx, inputs, output):
    # Options: ignore_index, temperature, renormalize.
    _save_for_recompute(ctx, inputs, output, n_tensors=4)  # zs, teacher_ids, teacher_logprobs, labels


def _topk_backward(ctx, grad_loss, _grad_row_stats):
    _forbid_double_backward()
    zs, teacher_ids, teacher_logprobs, labels, row_stats = _saved(ctx)
    if not ctx.needs_input_grad[0]:
        return (None,) * 7
    dzs = _ops.topk_logit_distill_bwd(grad_loss, zs, teacher_ids, teacher_logprobs, labels, row_stats, *ctx.options)
    return (dzs,) + (None,) * 6  # the teacher's ids and log-probabilities, labels and options: no gradient


torch.library.register_autograd("nitrobrew::topk_logit_distill_fwd", _topk_backward,
                                setup_context=_topk_setup_context)


@torch.library.register_fake("nitrobrew::topk_linear_distill_fwd")
def _topk_linear_distill_fwd_fake(xs, ws, teacher_ids, teacher_logprobs, labels, ignore_index, temperature,
                                  renormalize, chunk_v):
    torch._check(xs.dim() == 2 and ws.dim() == 2 and teacher_ids.dim() == 2,
                 lambda: "xs must be [N, D], ws [V, D] and teacher_ids [N, K]")
    n, k = xs.shape[0], teacher_ids.shape[1]
    return (xs.new_empty((n,), dtype=_stats_dtype(xs.dtype)),
            xs.new_empty((n, NUM_TOPK_ROW_STATS + k), dtype=torch.float64))


@torch.library.register_fake("nitrobrew::topk_linear_distill_bwd")
def _topk_linear_distill_bwd_fake(grad_loss, xs, ws, teacher_ids, teacher_logprobs, labels, row_stats, ignore_index,
                                  temperature, renormalize, chunk_v, compute_dxs, compute_dws):
    torch._check(grad_loss.shape == (xs.shape[0],), lambda: "grad_loss must be [N]")
    dxs = torch.empty_like(xs, memory_format=torch.contiguous_format) if compute_dxs else xs.new_empty((0,))
    dws = torch.empty_like(ws, memory_format=torch.contiguous_format) if compute_dws else ws.new_empty((0,))
    return dxs, dws


def _topk_linear_setup_context(ctx, inputs, output):
    # Options: ignore_index, temperature, renormalize, chunk_v.
    _save_for_recompute(ctx, inputs, output, n_tensors=5)  # xs, ws, teacher_ids, teacher_logprobs, labels


def _topk_linear_backward(ctx, grad_loss, _grad_row_stats):
    _forbid_double_backward()
    xs, ws, teacher_ids, teacher_logprobs, labels, row_stats = _saved(ctx)
    need_dxs, need_dws = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dxs or need_dws):
        return (None,) * 9
    dxs, dws = _ops.topk_linear_distill_bwd(grad_loss, xs, ws, teacher_ids, teacher_logprobs, labels, row_stats,
                                            *ctx.options, need_dxs, need_dws)
    # The teacher's ids and log-probabilities, labels and options receive no gradient.
    return (dxs if need_dxs else None, dws if need_dws else None) + (None,) * 7


torch.library.register_autograd("nitrobrew::topk_linear_distill_fwd", _topk_linear_backward,
                                setup_context=_topk_linear_setup_context)


NUM_ATTENTION_ROW_STATS = 5  # kNumAttentionRowStats in csrc/attention_kl_params.h


@torch.library.register_fake("nitrobrew::attention_kl_fwd")
def _attention_kl_fwd_fake(q_s, k_s, q_t, k_t, key_mask, reverse, causal, scale_s, scale_t, temperature,
                            deterministic):
    torch._check(q_s.dim() == 4 and k_s.dim() == 4 and q_t.dim() == 4 and k_t.dim() == 4,
                 lambda: "attention_kl: inputs must be [B, N, H, D]")
    b, n_q, h, _ = q_s.shape
    dtype = _stats_dtype(q_s.dtype)
    return (q_s.new_empty((b, h, n_q), dtype=dtype),
            q_s.new_empty((b, h, n_q, NUM_ATTENTION_ROW_STATS), dtype=dtype))


@torch.library.register_fake("nitrobrew::attention_kl_bwd")
def _attention_kl_bwd_fake(grad_loss, q_s, k_s, q_t, k_t, key_mask, row_stats, reverse, causal, scale_s, scale_t,
                           temperature, deterministic):
    return torch.empty_like(q_s, memory_format=torch.contiguous_format), torch.empty_like(
        k_s, memory_format=torch.contiguous_format)


def _attention_setup_context(ctx, inputs, output):
    # Options: reverse, causal, scale_s, scale_t, temperature, deterministic.
    _save_for_recompute(ctx, inputs, output, n_tensors=5)  # q_s, k_s, q_t, k_t, key_mask


def _attention_backward(ctx, grad_loss, _grad_row_stats):
    _forbid_double_backward()
    q_s, k_s, q_t, k_t, key_mask, row_stats = _saved(ctx)
    need_dq, need_dk = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dq or need_dk):
        return (None,) * 11
    dq, dk = _ops.attention_kl_bwd(grad_loss, q_s, k_s, q_t, k_t, key_mask, row_stats, *ctx.options)
    # The teacher's q_t, k_t, the mask and the options receive no gradient.
    return (dq if need_dq else None, dk if need_dk else None) + (None,) * 9


torch.library.register_autograd("nitrobrew::attention_kl_fwd", _attention_backward,
                                setup_context=_attention_setup_context)


def fused_linear_distill(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    labels: Tensor | None,
    *,
    ignore_index: int,
    beta: float,
    temperature: float,
    ce_weight: float,
    softcap_s: float | None,
    softcap_t: float | None,
    vocab_size: int,
    chunk_v: int,
) -> Tensor:
    """Per-row loss [N] of the fused-linear op (2-D inputs, options already checked)."""
    return _ops.fused_linear_distill_fwd(
        xs, xt, ws, wt, labels, ignore_index, beta, temperature, ce_weight, softcap_s, softcap_t, vocab_size, chunk_v
    )[0]


def logit_distill(zs: Tensor, zt: Tensor, labels: Tensor | None, *, ignore_index: int, beta: float,
                  temperature: float) -> Tensor:
    """Per-row loss [N] of the logit-level op (2-D logits, options already checked)."""
    return _ops.logit_distill_fwd(zs, zt, labels, ignore_index, beta, temperature)[0]


def topk_logit_distill(zs: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, labels: Tensor | None, *,
                       ignore_index: int, temperature: float, renormalize: bool) -> Tensor:
    """Per-row loss [N] of the top-K op from logits (2-D inputs, options already checked)."""
    return _ops.topk_logit_distill_fwd(zs, teacher_ids, teacher_logprobs, labels, ignore_index, temperature,
                                       renormalize)[0]


def topk_linear_distill(xs: Tensor, ws: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, labels: Tensor | None,
                        *, ignore_index: int, temperature: float, renormalize: bool, chunk_v: int) -> Tensor:
    """Per-row loss [N] of the top-K op from hidden states (2-D inputs, options already checked)."""
    return _ops.topk_linear_distill_fwd(xs, ws, teacher_ids, teacher_logprobs, labels, ignore_index, temperature,
                                        renormalize, chunk_v)[0]
