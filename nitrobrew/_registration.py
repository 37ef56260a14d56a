"""What torch.compile and autograd need of nitrobrew's operators, registered once for every family.

Every op is a pair (schemas in csrc/registration.cpp, kernels in csrc/<family>/):

    nitrobrew::<name>_fwd(t_0, ..., t_{k-1}, *options) -> (loss, row_stats)
    nitrobrew::<name>_bwd(grad_loss, t_0, ..., t_{k-1}, row_stats, *options[, *needs]) -> gradients

The backward recomputes from the inputs and the forward's per-row statistics, so any upstream
gradient per row is accepted. register_recompute_op gives such a pair its fake (meta) kernels and
its autograd formula; each family module calls it for its ops.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from nitrobrew._extension import load_extension

load_extension()

ops = torch.ops.nitrobrew


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Per-row losses and statistics are float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def save_tensors(ctx, tensors) -> None:
    """ctx.save_for_backward of `tensors` (None allowed), but for tensors made under torch.inference_mode
    (a teacher's logits or hidden states, typically), which cannot go through it: they are held on ctx
    as they are instead of being copied (for logits that copy would be [N x V]). They cannot be
    modified in place outside inference mode, so there is no version to check. (torch.compile cannot
    ask is_inference(); Dynamo treats such inputs itself.)"""
    held = {}
    if not torch.compiler.is_compiling():
        held = {i: t for i, t in enumerate(tensors) if isinstance(t, Tensor) and t.is_inference()}
    ctx.save_for_backward(*(None if i in held else t for i, t in enumerate(tensors)))
    ctx.held_inference_tensors = held


def saved_tensors(ctx) -> tuple:
    """The tensors save_tensors saved, in their order."""
    held = ctx.held_inference_tensors
    return tuple(held.get(i, t) for i, t in enumerate(ctx.saved_tensors))


def _save_for_recompute(ctx, inputs, output, n_tensors: int, backward_options: int | None) -> None:
    """Saves the first n_tensors inputs and the row statistics; the remaining inputs are options, of which
    the backward takes the first backward_options (all when None)."""
    _, row_stats = output
    save_tensors(ctx, (*inputs[:n_tensors], row_stats))
    ctx.options = inputs[n_tensors:][:backward_options]
    ctx.mark_non_differentiable(row_stats)


def register_recompute_op(
    name: str,
    *,
    n_tensors: int,
    differentiable: Sequence[int],
    fake_forward: Callable,
    needs_flags: bool = False,
    backward_options: int | None = None,
) -> None:
    """Registers the fake kernels of nitrobrew::<name>_fwd / _bwd and the forward's autograd.

    n_tensors: the forward's leading tensor arguments (saved for the backward; None allowed).
    differentiable: the positions of the inputs that get gradients, in the order the backward
        returns them (one tensor, or a tuple of them). Every other input gets none.
    fake_forward(*inputs) -> (loss, row_stats): empty tensors of the outputs' shapes and dtypes.
    needs_flags: the backward op takes, after the options, one bool per differentiable input saying
        whether its gradient is wanted (an empty tensor comes back for one that is not).
    backward_options: how many of the forward's options the backward takes (the first ones; the rest
        concern the forward alone); None: all of them.
    """
    differentiable = tuple(differentiable)
    torch.library.register_fake(f"nitrobrew::{name}_fwd")(fake_forward)

    def fake_backward(grad_loss, *args):
        tensors = args[:n_tensors]
        needs = args[len(args) - len(differentiable):] if needs_flags else (True,) * len(differentiable)
        torch._check(grad_loss.dim() >= 1, lambda: "grad_loss must hold one entry per row")
        # An optional input (None) gets an empty gradient like one not wanted, in the first input's dtype.
        grads = tuple(
            torch.empty_like(tensors[i], memory_format=torch.contiguous_format) if need and tensors[i] is not None
            else (tensors[i] if tensors[i] is not None else tensors[0]).new_empty((0,))
            for i, need in zip(differentiable, needs)
        )
        return grads[0] if len(grads) == 1 else grads

    torch.library.register_fake(f"nitrobrew::{name}_bwd")(fake_backward)
    backward_op = getattr(ops, f"{name}_bwd")

    def setup_context(ctx, inputs, output):
        _save_for_recompute(ctx, inputs, output, n_tensors, backward_options)

    def backward(ctx, grad_loss, _grad_row_stats):
        if torch.is_grad_enabled():
            raise RuntimeError("nitrobrew's fused losses support one backward pass; double backward "
                               "(create_graph=True) is not implemented")
        *tensors, row_stats = saved_tensors(ctx)
        n_inputs = len(ctx.needs_input_grad)
        needs = tuple(ctx.needs_input_grad[i] for i in differentiable)
        if not any(needs):
            return (None,) * n_inputs
        flags = needs if needs_flags else ()
        grads = backward_op(grad_loss, *tensors, row_stats, *ctx.options, *flags)
        grads = (grads,) if isinstance(grads, Tensor) else grads
        out = [None] * n_inputs
        for i, need, grad in zip(differentiable, needs, grads):
            out[i] = grad if need else None
        return tuple(out)

    torch.library.register_autograd(f"nitrobrew::{name}_fwd", backward, setup_context=setup_context)


def row_outputs(like: Tensor, rows: int, columns: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Fake outputs of a row-wise forward: loss [rows] and row_stats [rows, columns] (in `dtype`, by
    default the per-row dtype of `like`)."""
    loss_dtype = stats_dtype(like.dtype)
    return like.new_empty((rows,), dtype=loss_dtype), like.new_empty((rows, columns), dtype=dtype or loss_dtype)
