"""topk_logprobs composed from nitrobrew's and ATen's pieces: token chunks of float32 logits (the `products`
op: cuBLAS with a float32 output), then ATen's top-K, log-sum-exp and entropy over each chunk. Memory: one
chunk of CHUNK_BYTES (256 MiB), never the whole [N, V]. It was the op's CUDA path before its kernel
(csrc/topk_logprobs/topk_logprobs_cuda.cu); it stays as the benchmark's composition baseline, and the tests
hold it to the float64 reference on the CPU as they hold the op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nitrobrew._registration import ops

# The chunk's working set: the float32 logits, their shift by the row maximum, the int64 sort keys and the
# temporaries of the entropy and the keys (29 bytes a logit at the peak measured on the CPU before the shift was
# kept: ~33 now), at most this many bytes.
CHUNK_BYTES = 256 << 20
_BYTES_PER_LOGIT = 36
_LOW32 = 0xFFFFFFFF


def chunk_rows(vocab_size: int) -> int:
    return max(1, CHUNK_BYTES // (_BYTES_PER_LOGIT * vocab_size))


def _order_keys(s: Tensor) -> Tensor:
    """int64 keys that order a chunk's float32 logits as the output does: larger value first, ties to the
    lower id (the id in the low 32 bits, complemented). NaN rows are replaced before the caller reads them."""
    bits = s.view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the float's value, as a signed int32
    ids = torch.arange(s.shape[1], device=s.device, dtype=torch.int64)
    return (ordered.to(torch.int64) << 32) | (_LOW32 - ids)


def _chunk(x: Tensor, w: Tensor, k: int, bias, inv_t: float, softcap, logit_scale: float, vocab: int):
    s = ops.products(x, w, vocab)  # [rows, vocab] float32, the GEMM's only rounding
    if bias is not None:
        s.add_(bias[:vocab].to(s.dtype))
    if logit_scale != 1.0:
        s.mul_(logit_scale)
    if softcap is not None:
        s = torch.tanh(s / softcap).mul_(softcap)
    s.mul_(inv_t)
    # Everything from s - max (exact for nearby logits): s - lse would carry lse's float32 rounding (~1e-8 |lse|)
    # into the log-probabilities and the entropy.
    top = s.amax(dim=1)
    finite_or_neg_inf = torch.isfinite(s) | (s == float("-inf"))
    undefined = ~finite_or_neg_inf.all(dim=1) | (top == float("-inf"))
    shifted = s - top[:, None]
    lse_shifted = torch.logsumexp(shifted, dim=1)
    lse = top + lse_shifted
    centered = shifted - lse_shifted[:, None]
    entropy = -torch.where(s > float("-inf"), centered.exp() * centered, 0.0).sum(dim=1)
    del centered
    # + 0.0 turns -0.0 into +0.0: the two are equal logits, a tie, but their bits order them.
    keys = torch.topk(_order_keys(torch.where(finite_or_neg_inf, s, 0.0) + 0.0), k, dim=1).values
    ids = _LOW32 - (keys & _LOW32)
    logprobs = shifted.gather(1, ids) - lse_shifted[:, None]
    first_ids = torch.arange(k, device=x.device, dtype=torch.int64).expand_as(ids)
    ids = torch.where(undefined[:, None], first_ids, ids)
    nan = torch.full_like(lse, float("nan"))
    logprobs = torch.where(undefined[:, None], nan[:, None], logprobs)
    stats = torch.stack([torch.where(undefined, nan, lse), torch.where(undefined, nan, entropy)], dim=1)
    return logprobs, ids, stats


def topk_logprobs_chunked(x: Tensor, w: Tensor, k: int, bias, temperature: float, softcap, logit_scale: float,
                          vocab_size: int, chunk_v: int = 0, rows: int | None = None):
    """nitrobrew::topk_logprobs's outputs (registration.cpp) for float32, bfloat16 and float16 x and w."""
    if x.dtype == torch.float64:
        raise TypeError(f"float64 inputs are supported on the CPU only, got them on {x.device}")
    n = x.shape[0]
    rows = rows or chunk_rows(vocab_size)
    parts = [_chunk(x[r0:r0 + rows], w, k, bias, 1.0 / temperature, softcap, logit_scale, vocab_size)
             for r0 in range(0, n, rows)]
    if not parts:
        return (x.new_empty((0, k), dtype=torch.float32), x.new_empty((0, k), dtype=torch.int64),
                x.new_empty((0, 2), dtype=torch.float32))
    return tuple(torch.cat(t) for t in zip(*parts))
