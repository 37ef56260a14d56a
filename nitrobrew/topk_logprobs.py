"""The teacher's side of top-K distillation: a model's K most likely tokens and their log-probabilities
over its whole vocabulary, from its final hidden states and unembedding, without the [N, V] logits.

    logprobs, ids = nitrobrew.topk_logprobs(h_teacher, lm_head_weight, k=32)
    loss = nitrobrew.topk_kl(h_student, ws, ids, logprobs)          # now, or from a stored dataset later

The logits are transformed exactly as the fused losses transform them:
softcap(logit_scale * (x @ w[:vocab_size].T + bias)) / temperature.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from nitrobrew import _checks
from nitrobrew._extension import kernel_device_types
from nitrobrew._registration import ops, stats_dtype

__all__ = ["topk_logprobs", "MAX_K"]

# The largest k (kMaxTopKLogprobsK in csrc/topk_logprobs/topk_logprobs_params.h).
MAX_K = 1024


@torch.library.register_fake("nitrobrew::topk_logprobs")
def _(x, w, k, bias, temperature, softcap, logit_scale, vocab_size, chunk_v):
    torch._check(x.dim() == 2 and w.dim() == 2, lambda: "x must be [N, D] and w [V, D]")
    dtype = stats_dtype(x.dtype)
    n = x.shape[0]
    return (x.new_empty((n, k), dtype=dtype), x.new_empty((n, k), dtype=torch.int64),
            x.new_empty((n, 2), dtype=dtype))


_KERNEL_DEVICE_TYPES = kernel_device_types("topk_logprobs")


def _k(value, vocab_size: int) -> int:
    value = _checks._scalar(value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"k must be an integer, got {value!r}")
    if not 1 <= value <= min(vocab_size, MAX_K):
        raise ValueError(f"k must be in [1, min(vocab_size, {MAX_K})] = [1, {min(vocab_size, MAX_K)}], got {value}")
    return int(value)


def topk_logprobs(x: Tensor, w: Tensor, k: int, *, temperature: float = 1.0, bias: Tensor | None = None,
                  logit_scale: float = 1.0, softcap: float | None = None, vocab_size: int | None = None,
                  return_stats: bool = False, chunk_V: int | None = None):
    """The k most likely tokens of each row of a model's logits, and their log-probabilities over the
    whole vocabulary, in one walk over the vocabulary: no [N, V] tensor is formed.

    Args:
        x: [..., D] final hidden states. w: [V_rows, D] unembedding (lm_head weight), x's dtype and device.
        k: how many tokens a row keeps, 1 <= k <= min(vocab_size, MAX_K = 1024).
        temperature: divides the logits (after the soft-cap), as in nitrobrew.forward_kl.
        bias: the lm_head's [V_rows] bias, or None. logit_scale: a positive multiplier of the logits before
            the soft-cap (Cohere's logit_scale, 1 / Granite's logits_scaling). softcap: Gemma's
            final_logit_softcapping, or None. nitrobrew.hf.unembedding(model) reads all three.
        vocab_size: the real vocabulary (rows of w past it are padding and never chosen); default V_rows.
        return_stats: also return each row's log-normalizer (logsumexp of the logits) and entropy (nats).
        chunk_V: vocabulary tile width of the CPU walk (None = automatic).

    Returns (logprobs, ids), or (logprobs, ids, logsumexp, entropy) with return_stats: logprobs [..., k]
    float32 (float64 for float64 inputs, which run on the CPU only), sorted descending, equal logits ordered
    by the lower id; ids [..., k] int64;
    logsumexp and entropy [...]. These are what nitrobrew.topk_kl takes as teacher_logprobs and teacher_ids.
    A row with a NaN or +inf logit, or with every logit -inf, has no distribution: its log-probabilities and
    statistics are NaN and its ids 0..k-1. No gradients flow (the teacher's side).
    """
    for name, value in (("x", x), ("w", w)):
        _checks.tensor(value, name)
        _checks.floating(value, name)
    if x.dim() < 1 or w.dim() != 2 or w.shape[1] != x.shape[-1] or w.shape[0] < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., D] and w [V, D] with V >= 1 and D >= 1, got {tuple(x.shape)} and "
                         f"{tuple(w.shape)}{_checks.logits_hint(x, w)}")
    _checks.same_device({"x": x, "w": w})
    x, w = _checks.autocast_inputs(x, w)
    if w.dtype != x.dtype:
        raise TypeError(f"x and w must share one dtype, got {x.dtype} and {w.dtype} (or call under "
                        f"torch.autocast, which casts both to its dtype)")
    _checks.kernel_device(x.device, _KERNEL_DEVICE_TYPES)
    vocab_size = _checks.optional_positive_int(vocab_size, "vocab_size")
    if vocab_size is None:
        vocab_size = w.shape[0]
    elif vocab_size > w.shape[0]:
        raise ValueError(f"vocab_size must be at most w.shape[0] = {w.shape[0]}, got {vocab_size}")
    k = _k(k, vocab_size)
    bias = _checks.bias(bias, w, "bias", "w")
    temperature = _checks.positive_number(temperature, "temperature")
    logit_scale = _checks.positive_number(logit_scale, "logit_scale")
    softcap = _checks.optional_positive_number(softcap, "softcap")
    chunk_V = _checks.optional_positive_int(chunk_V, "chunk_V")
    lead_shape = x.shape[:-1]
    with torch.no_grad():
        logprobs, ids, stats = ops.topk_logprobs(x.reshape(-1, x.shape[-1]), w, k, bias, temperature, softcap,
                                                 logit_scale, vocab_size, chunk_V or 0)
    logprobs, ids = logprobs.reshape(*lead_shape, k), ids.reshape(*lead_shape, k)
    if not return_stats:
        return logprobs, ids
    return logprobs, ids, stats[:, 0].reshape(lead_shape), stats[:, 1].reshape(lead_shape)


topk_logprobs.MAX_K = MAX_K  # nitrobrew.topk_logprobs is this function (the module's name is shadowed)
