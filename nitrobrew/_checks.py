"""Argument checks shared by the public loss functions: each error names the argument
and the form it should have."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

REDUCTIONS = ("none", "sum", "mean", "batchmean")
FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def tensor(value, name: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def floating(value: Tensor, name: str) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float64, bfloat16 or float16, got {value.dtype}")


def _scalar(value):
    """A 0-d tensor as the Python number it holds (numpy scalars already are numbers.Real / Integral);
    anything else as it is."""
    if isinstance(value, Tensor) and value.dim() == 0 and value.dtype != torch.bool and not value.is_complex():
        return value.item()
    return value


def _real(value) -> bool:
    # torch.compile(dynamic=True) passes Python floats as SymFloats; float() specializes them.
    return not isinstance(value, bool) and isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt))


def _finite(value) -> bool:
    # Comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float option
    # can arrive as a symbolic float, which comparisons guard on and math.isfinite cannot trace.
    return value == value and value != math.inf and value != -math.inf


def positive_number(value, name: str) -> float:
    value = _scalar(value)
    if not _real(value) or not _finite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def optional_positive_number(value, name: str) -> float | None:
    return None if value is None else positive_number(value, name)


def non_negative_number(value, name: str) -> float:
    value = _scalar(value)
    if not _real(value) or not _finite(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


# float32's smallest normal number: the kernels hold a mixture's weights in float32, whose special-function log
# (CUDA, 16-bit inputs) flushes a denormal weight to 0.
FLOAT32_TINY = 1.1754943508222875e-38


def unit_interval(value, name: str) -> float:
    """A mixture weight (JSD's beta, the skew KLs' alpha): in [0, 1], and 0 or at least FLOAT32_TINY."""
    value = _scalar(value)
    if not _real(value) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if 0.0 < float(value) < FLOAT32_TINY:
        raise ValueError(f"{name} must be 0 or at least {FLOAT32_TINY} (float32's smallest normal number: the "
                         f"kernels hold it in float32), got {value!r}")
    return float(value)


def reduction(value) -> str:
    if value not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got {value!r}")
    return "mean" if value == "batchmean" else value


def optional_positive_int(value, name: str) -> int | None:
    if value is None:
        return None
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    return int(value)


def labels(value, lead_shape: torch.Size, device: torch.device, of: str = "xs") -> Tensor | None:
    if value is None:
        return None
    tensor(value, "labels")
    if value.dtype != torch.int64:
        raise TypeError(f"labels must be an int64 tensor, got {value.dtype}")
    if value.shape != lead_shape:
        raise ValueError(f"labels must have the leading shape of {of} {tuple(lead_shape)}, got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"labels must be on {device}, got {value.device}")
    return value


def ignore_index(value) -> int:
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"ignore_index must be an integer (a Python int, a numpy integer or a 0-d integer tensor), "
                        f"got {value!r}")
    return int(value)


def kernel_device(device: torch.device, supported) -> None:
    """The extension has kernels for `device` (this build's kernel device types: `supported`). Meta
    tensors go through the ops' fake kernels: shapes and dtypes without data."""
    if device.type not in supported and device.type != "meta":
        raise RuntimeError(
            f"this build of nitrobrew has no kernels for {device.type} tensors; rebuild it on a machine "
            f"with a CUDA toolkit and a CUDA build of torch (see the README's build section)"
        )


def same_device(tensors: dict) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listed = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(f"all inputs must be on one device, got {listed}")


TOPK_NORMALIZATIONS = ("full", "topk")


def topk_teacher(teacher_ids, teacher_logprobs, normalize, lead_shape: torch.Size, vocab: int | None, of: str) -> None:
    """The top-K teacher's [..., K] ids (int64) and log-probabilities (floating, same shape, leading shape
    of `of`), 1 <= K <= vocab, and a known normalization. vocab None: a sharded vocabulary (K >= 1). The ids'
    range and mass are topk_rows', once the labels are known."""
    tensor(teacher_ids, "teacher_ids")
    tensor(teacher_logprobs, "teacher_logprobs")
    if teacher_ids.dtype != torch.int64:
        raise TypeError(f"teacher_ids must be int64, got {teacher_ids.dtype}")
    if not teacher_logprobs.is_floating_point():
        raise TypeError(f"teacher_logprobs must be floating point, got {teacher_logprobs.dtype}")
    if normalize not in TOPK_NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {TOPK_NORMALIZATIONS}, got {normalize!r}")
    if teacher_ids.shape != teacher_logprobs.shape or teacher_ids.shape[:-1] != lead_shape:
        raise ValueError(f"teacher_ids and teacher_logprobs must both be [..., K] with {of}'s leading shape "
                         f"{tuple(lead_shape)}, got {tuple(teacher_ids.shape)} and {tuple(teacher_logprobs.shape)}")
    k = teacher_ids.shape[-1]
    if not 1 <= k <= (vocab if vocab is not None else max(k, 1)):
        raise ValueError(f"K (the last dimension of teacher_ids) must be in [1, V = {vocab}], got {k}")


def host_checks_possible(t: Tensor) -> bool:
    """Whether a check may read `t` on the host: not for meta tensors, not while torch.compile traces
    and not while a CUDA graph captures. Where it may not, the ops' own guards apply (docs/design.md,
    "Bad input"): the CPU ops raise; the CUDA kernels give the affected rows a NaN loss and gradient."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def ids_in_range(ids: Tensor, vocab: int, name: str, ignore_index: int | None = None) -> None:
    """Every entry of `ids` in [0, vocab) (or equal to ignore_index), or an IndexError naming the first
    offending entry, its position and how many there are.

    Reads one flag on the host: on CUDA a synchronization, the price of an error the training job can
    catch (a device-side assertion would end the process's CUDA context). Skipped where no host read
    is possible (host_checks_possible)."""
    if ids.numel() == 0 or not host_checks_possible(ids):
        return
    outside = _outside(ids, vocab, ignore_index)
    if bool(outside.any()):
        _raise_outside(ids, outside, vocab, name, ignore_index)


def _outside(ids: Tensor, vocab: int, ignore_index: int | None) -> Tensor:
    outside = (ids < 0) | (ids >= vocab)
    return outside if ignore_index is None else outside & (ids != ignore_index)


def _raise_outside(ids: Tensor, outside: Tensor, vocab: int, name: str, ignore_index: int | None) -> None:
    position = tuple(int(i) for i in outside.nonzero()[0])
    value = int(ids[position])
    allowed = "" if ignore_index is None else f" and is not ignore_index ({ignore_index})"
    count = int(outside.sum())
    message = (f"{name}{list(position)} = {value} is outside [0, V = {vocab}){allowed}; {count} of the {ids.numel()} "
               f"entries {'is' if count == 1 else 'are'} outside it")
    if value < 0:  # -1 and the like mark padding
        message += (". A negative id usually marks padding: leave such positions out of the loss with labels "
                    "equal to ignore_index (-100 by default)" if ignore_index is None else
                    f". A negative id usually marks padding: give those positions ignore_index ({ignore_index})")
    raise IndexError(message)


# How far a row's teacher mass sum_k exp(teacher_logprobs) may exceed 1 with normalize="full". Log-probabilities
# rounded to bf16 (2^-9 relative each) move a high-entropy row's mass by up to ~entropy * 2^-9 (measured: 1.03 for
# K = V = 32000, and more from a bf16 log_softmax's rounded normalizer); the mistakes the check is for give >= 1.25:
# probabilities (each exp(p) >= 1, so K >= 2 sums to >= 2) or logits passed as log-probabilities.
TOPK_MASS_SLACK = 0.25


def topk_rows(teacher_ids: Tensor, teacher_logprobs: Tensor, normalize: str, labels: Tensor | None, ignore_index: int,
              vocab: int | None) -> tuple[Tensor, Tensor]:
    """(teacher_ids, teacher_logprobs) with the masked rows (labels == ignore_index) set to id 0 and log-probability
    -inf, after checking the rows the loss reads: ids in [0, vocab), and with normalize="full" teacher_mass's. The
    loss reads no masked row, and padded positions often carry ids of -1 there. vocab None: a sharded vocabulary,
    whose ids and masses nitrobrew.distributed checks on the inputs every rank holds alike (tokens gathered), so
    that every rank raises alike. One host read for both checks."""
    if labels is not None:
        kept = (labels != ignore_index).unsqueeze(-1)
        teacher_ids = torch.where(kept, teacher_ids, torch.zeros_like(teacher_ids))
        teacher_logprobs = torch.where(kept, teacher_logprobs, torch.full_like(teacher_logprobs, float("-inf")))
    if vocab is None or teacher_ids.numel() == 0 or not host_checks_possible(teacher_ids):
        return teacher_ids, teacher_logprobs
    outside = _outside(teacher_ids, vocab, None)
    excess = _mass_excess(teacher_logprobs) if normalize == "full" else None
    flags = [f.any() for f in (outside, excess) if f is not None]
    if any(torch.stack(flags).tolist()):
        if bool(outside.any()):
            _raise_outside(teacher_ids, outside, vocab, "teacher_ids", None)
        _raise_mass(teacher_logprobs, excess)
    return teacher_ids, teacher_logprobs


def teacher_mass(teacher_logprobs: Tensor) -> None:
    """normalize="full" takes q_k = exp(teacher_logprobs_k) as given: a row whose mass sum_k q_k passes
    1 + TOPK_MASS_SLACK (probabilities or logits passed as log-probabilities) is a ValueError; a row of a non-finite
    mass is the non-finite rule's, not an error. Skipped where no host read is possible (host_checks_possible)."""
    if teacher_logprobs.numel() == 0 or not host_checks_possible(teacher_logprobs):
        return
    excess = _mass_excess(teacher_logprobs)
    if bool(excess.any()):
        _raise_mass(teacher_logprobs, excess)


def _mass_excess(teacher_logprobs: Tensor) -> Tensor:
    # The log of the mass, in the inputs' dtype (logsumexp accumulates in float32): no overflow of exp at logits of 89+.
    log_mass = torch.logsumexp(teacher_logprobs.detach(), -1)
    return (log_mass > math.log1p(TOPK_MASS_SLACK)) & log_mass.isfinite()


def _raise_mass(teacher_logprobs: Tensor, excess: Tensor) -> None:
    row = tuple(int(i) for i in excess.nonzero()[0])
    log_mass = float(torch.logsumexp(teacher_logprobs[row].detach().double(), -1))
    mass = math.exp(log_mass) if log_mass < 700 else float("inf")
    raise ValueError(f"teacher_logprobs must be log-probabilities: with normalize=\"full\" the probabilities "
                     f"exp(teacher_logprobs) of a row sum to at most 1, but row {list(row)}'s sum to "
                     f"{mass:.4g} ({int(excess.sum())} such rows). Pass the teacher's log_softmax at "
                     f"its top-K ids (nitrobrew.topk_logprobs gives them), or normalize=\"topk\", which "
                     f"renormalizes over the K ids and takes logits as they are")


def logits_hint(x: Tensor, w: Tensor) -> str:
    """A hint for hidden states x: [..., D] that do not match w: [V, D] where x's last dimension is w's first:
    logits passed to a hidden-state op (w taller than wide, as [V, D] is), or w transposed (wider than tall: a
    [D, V] matrix; an lm_head's weight is [V, D])."""
    if x.dim() >= 1 and w.dim() == 2 and x.shape[-1] == w.shape[0] and x.shape[-1] != w.shape[1]:
        if w.shape[0] < w.shape[1]:
            return (f" (a [D, V] matrix? it must be [V, D], as lm_head.weight is: pass the weight untransposed, "
                    f"not {tuple(w.shape)})")
        return (f" ({tuple(x.shape)}'s last dimension is the vocabulary size V = {w.shape[0]}: for logits, use "
                "nitrobrew.logits)")
    return ""


def autocast_inputs(*tensors):
    """Under torch.autocast, compute in its dtype, as the lm_head matmuls it replaces would."""
    device_type = tensors[0].device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def bias(value, weight: Tensor, name: str, weight_name: str) -> Tensor | None:
    """An lm_head bias: None, or a floating [V_rows] tensor on the weight's device (one entry per row of
    the weight), returned in the weight's dtype (a differentiable cast, so a float32 bias under
    autocast still gets its gradient)."""
    if value is None:
        return None
    tensor(value, name)
    floating(value, name)
    if value.dim() != 1 or value.shape[0] != weight.shape[0]:
        raise ValueError(f"{name} must be [V] with one entry per row of {weight_name} ({weight.shape[0]}), got shape "
                         f"{tuple(value.shape)}")
    if value.device != weight.device:
        raise ValueError(f"{name} must be on {weight_name}'s device {weight.device}, got {value.device}")
    return value.to(weight.dtype)
