"""Distillation losses for Hugging Face causal language models, computed without the [B, T, V] logits.

    loss = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=mask)

runs both decoders without their `lm_head` (the teacher without gradients) and hands the final hidden
states and the unembeddings to nitrobrew's fused losses. It equals the loss computed from the models'
own `.logits` with Hugging Face's causal shift: position n's distributions are scored where
`labels[:, n + 1] != ignore_index`, or with `labels=None` where `attention_mask[:, n + 1] == 1` (every
position but the last without a mask).

`unembedding(model)` is the piece underneath, for users who run the decoders themselves: the matrix
that turns a model's final hidden state into logits, and the transform the model applies to them.
`capture_attention` and `attention_distillation_loss` (hf_attention.py) distill attention maps.

Models may be wrapped in DistributedDataParallel or sharded with FSDP2 (`fully_shard`, the root included):
each model's decoder then runs inside its wrapper's forward, and a sharded lm_head is used as the DTensor
shard FSDP2 keeps, without gathering it (_hf_wrappers.py; docs/hf.md).

transformers is an optional dependency: this module imports none of it.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import Tensor

from nitrobrew import _checks, _divergences, _hf_wrappers, distributed, fused_linear
from nitrobrew.hf_attention import CapturedAttention, attention_distillation_loss, capture_attention
from nitrobrew.topk_logprobs import topk_logprobs

__all__ = ["Unembedding", "unembedding", "distillation_loss", "teacher_topk", "scored_labels", "capture_attention",
           "attention_distillation_loss", "CapturedAttention"]

LOSSES = _divergences.DIVERGENCES


@dataclasses.dataclass(frozen=True)
class Unembedding:
    """How a causal LM turns its final hidden state h into logits:
    `softcap(scale * (h @ weight.T + bias))`, with softcap(z) = cap * tanh(z / cap) when `softcap` is set.

    weight: the `lm_head` weight [V_rows, D] (tied or not); bias: its bias [V_rows] or None;
    scale: a multiplier of the logits (Cohere's `logit_scale`, 1 / Granite's `logits_scaling`, ...; 1.0 for
    most families);
    softcap: Gemma-2/3's `final_logit_softcapping`, or None."""

    weight: Tensor
    bias: Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None


def _config_number(config, *names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    return None


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def unembedding(model) -> Unembedding:
    """The unembedding of a Hugging Face causal LM (`*ForCausalLM`, also under torch.compile or PEFT):
    its output embedding's weight and bias, and the family's logit transform read from its config
    (`final_logit_softcapping`, `logit_scale`, `logits_scaling`). Raises a ValueError for a model
    without a linear output embedding."""
    outer, model = model, _unwrapped(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = _hf_wrappers.managed_param(outer, head, "weight") if head is not None else None
    if hasattr(weight, "ds_id") or hasattr(weight, "ds_numel"):
        raise NotImplementedError(
            f"{type(model).__name__}'s lm_head weight is partitioned by DeepSpeed ZeRO-3, which nitrobrew.hf cannot "
            f"read. Use FSDP2 (fully_shard, or accelerate's FSDP2 plugin), or ZeRO stage 1 or 2")
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"{type(model).__name__} has no linear output embedding (lm_head) whose weight nitrobrew "
                         f"can read; got {type(head).__name__}")
    if distributed.is_dtensor(weight) and not _hf_wrappers.sharded(outer):
        raise NotImplementedError(
            f"{type(model).__name__}'s lm_head weight is a DTensor outside FSDP2 (tensor parallelism): nitrobrew.hf "
            f"does not take tensor-parallel models. Run the decoders and pass their last hidden states and the DTensor "
            f"lm_head weights to nitrobrew.forward_kl / reverse_kl / jsd, which take them (docs/distributed.md)")
    if getattr(head, "lora_A", None) is not None or type(head).__name__.startswith("Lora"):
        raise ValueError("the lm_head itself is adapted (LoRA on the output embedding): nitrobrew reads the "
                         "lm_head's weight and would miss the adapter; keep lm_head out of target_modules")
    config = _text_config(model.config)
    # Multipliers of the logits before any soft-cap: Cohere's logit_scale, Muse Glimmer's output_multiplier,
    # Falcon-H1's lm_head_multiplier; Granite and MiniCPM3 divide by logits_scaling, HyperCLOVA X multiplies.
    scale = _config_number(config, "logit_scale", "output_multiplier", "lm_head_multiplier")
    if scale is None:
        scaling = _config_number(config, "logits_scaling")
        if scaling is not None:
            scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1.0 / scaling
    return Unembedding(weight=weight, bias=_hf_wrappers.managed_param(outer, head, "bias"),
                       scale=1.0 if scale is None else scale,
                       softcap=_config_number(config, "final_logit_softcapping"))


_unwrapped = _hf_wrappers.unwrapped


def _decoder(model):
    model = _unwrapped(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder to run without its lm_head "
                         f"(get_decoder() gave {type(decoder).__name__})")
    return decoder


def _final_hidden_states(model, input_ids, attention_mask, **kwargs) -> Tensor:
    out = _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


# Models whose unembedding was checked against their own logits once (nitrobrew.hf never trusts a config
# alone: a family with a transform it does not know fails the check instead of giving a wrong loss).
_CHECKED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _check_against_own_logits(model, u: Unembedding, input_ids) -> None:
    """One no-grad forward of the model (through its DDP or FSDP2 wrapper) on a probe of 8 tokens: its own logits
    against the unembedding applied to its decoder's output (caught by a hook). A sharded lm_head is compared on
    this rank's rows; the ranks of a wrapped model agree on the worst error (all-reduced), so that all raise
    together."""
    wrapper, inner = _hf_wrappers.split(model)
    if inner in _CHECKED:
        return
    probe = input_ids[:1, : min(input_ids.shape[1], 8)]
    captured = {}

    def capture(module, args, out):
        captured["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    hook = _decoder(inner).register_forward_hook(capture)
    training = {m: m.training for m in inner.modules()}
    inner.eval()  # no dropout: the logits and the hidden states come from one forward
    try:
        with torch.no_grad():
            own = wrapper(input_ids=probe, use_cache=False).logits.float()
    finally:
        hook.remove()
        for m, flag in training.items():
            m.training = flag
    weight, bias = u.weight.detach(), None if u.bias is None else u.bias.detach()
    if distributed.is_dtensor(weight):  # this rank's rows of the vocabulary
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        (rows, _), (offset, _) = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh,
                                                                        weight.placements)
        own = own[..., offset:offset + rows]
        weight = weight.to_local()
        bias = None if bias is None else bias.to_local() if distributed.is_dtensor(bias) else bias[offset:offset + rows]
    z = captured["h"].float() @ weight.float().T
    if bias is not None:
        z = z + bias.float()
    z = z * u.scale
    if u.softcap is not None:
        z = u.softcap * torch.tanh(z / u.softcap)
    err = (z - own).abs().max() if own.numel() else own.new_zeros(())
    largest = own.abs().max() if own.numel() else own.new_zeros(())
    group = _hf_wrappers.check_group(wrapper, u.weight)
    if group is not None:
        import torch.distributed as dist

        both = torch.stack([err, largest])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        err, largest = both[0], both[1]
    # 2% of the largest logit: a Trainer's mixed precision (accelerate wraps the model's forward in autocast)
    # rounds the model's own logits to bfloat16, while the transforms this guards against (a scale, a
    # soft-cap, an offset) move them by far more.
    if not err.item() <= 2e-2 * max(1.0, largest.item()):
        name = type(inner).__name__
        name = name[4:] if name.startswith("FSDP") else name  # fully_shard's class
        raise ValueError(
            f"{name}: its logits are not softcap(scale * (h @ lm_head.T + bias)) with the transform "
            f"nitrobrew read from its config (scale {u.scale}, softcap {u.softcap}); max difference {err.item():.3g}. "
            f"This model family transforms its logits in a way nitrobrew.hf does not know yet")
    _CHECKED[inner] = True


def scored_labels(input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                  ignore_index: int = -100) -> Tensor:
    """[B, T - 1] int64 labels of the shifted positions that distillation_loss scores: with `labels`,
    labels[:, 1:] (ignore_index where not scored; attention_mask is not read); else token n + 1, or
    ignore_index where attention_mask[:, n + 1] == 0. Pass them as `labels=` to nitrobrew.topk_kl with the
    teacher's top-K from teacher_topk to score the same positions."""
    _checks.tensor(input_ids, "input_ids")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
    if attention_mask is not None:
        _checks.tensor(attention_mask, "attention_mask")
    return _scored_positions(input_ids, attention_mask, labels, _checks.ignore_index(ignore_index))


def _scored_positions(input_ids, attention_mask, labels, ignore_index) -> Tensor:
    """[B, T - 1] int64 labels of the shifted positions: position n's target is token n + 1, or
    ignore_index where it is not scored."""
    if labels is not None:
        _checks.tensor(labels, "labels")
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(labels.shape)}")
        return labels[:, 1:].long()
    targets = input_ids[:, 1:].long()
    if attention_mask is None:
        return targets
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    return torch.where(attention_mask[:, 1:] != 0, targets, torch.full_like(targets, ignore_index))


def distillation_loss(student, teacher, input_ids: Tensor, *, attention_mask: Tensor | None = None,
                      labels: Tensor | None = None, loss: str = "forward_kl", beta: float | None = None,
                      alpha: float | None = None, temperature: float = 1.0, reduction: str = "mean",
                      ce_weight: float = 0.0,
                      vocab_size: int | None = None, ignore_index: int = -100, check: bool = True,
                      grad_in_forward: bool | None = None, grad_chunk_mib: int | None = None) -> Tensor:
    """Distillation loss between two Hugging Face causal LMs that share a tokenizer, from their final
    hidden states and unembeddings: no [B, T, V] tensor is formed.

    loss: "forward_kl" (KL(teacher || student)), "reverse_kl", "jsd" (generalized, with `beta`, default 0.5),
    "skew_forward_kl" / "skew_reverse_kl" (DistiLLM's, with `alpha`, default 0.1) or "tvd" (nitrobrew.fused_linear);
    a weight given to a loss that does not take it is an error.
    Scored positions follow Hugging Face's causal shift (position n predicts token n + 1): where
    `labels[:, n + 1] != ignore_index`, else where `attention_mask[:, n + 1] == 1`, else every position
    but the last. ce_weight > 0 adds the student's cross-entropy at `labels[:, n + 1]` (or the next
    token). reduction "none" returns [B, T - 1], aligned with the shifted positions (0 where not scored).
    vocab_size: the real vocabulary when the two lm_heads have different row counts (padding).
    check: verify once per model that its unembedding reproduces its own logits (a short forward of 8
    tokens); a family whose logit transform nitrobrew does not know raises instead of a wrong loss.
    grad_in_forward, grad_chunk_mib: which path forms the gradients, and the training path's memory bound
    (nitrobrew.forward_kl's options; None: automatic, 2048 MiB).
    The teacher runs under torch.no_grad(); gradients reach the student's parameters."""
    _divergences.check_name(loss)
    weight = _divergences.chosen_weight(loss, beta, alpha)
    _checks.tensor(input_ids, "input_ids")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2 (a position and its next token), "
                         f"got {tuple(input_ids.shape)}")
    u_s, u_t = unembedding(student), unembedding(teacher)
    if u_s.weight.shape[0] != u_t.weight.shape[0] and vocab_size is None:
        raise ValueError(f"the student's lm_head has {u_s.weight.shape[0]} rows and the teacher's "
                         f"{u_t.weight.shape[0]}: pass vocab_size, the size of the shared tokenizer's vocabulary")
    if check:
        _check_against_own_logits(student, u_s, input_ids)
        _check_against_own_logits(teacher, u_t, input_ids)
    targets = _scored_positions(input_ids, attention_mask, labels, ignore_index)
    s_wrapper, s_inner = _hf_wrappers.split(student)
    t_wrapper, t_inner = _hf_wrappers.split(teacher)
    with torch.no_grad():  # the teacher first, through its own wrapper
        h_t = _hf_wrappers.run_through(t_wrapper, t_inner, _final_hidden_states, t_inner, input_ids,
                                       attention_mask)[:, :-1]
    w_t = u_t.weight.detach()
    bias_t = None if u_t.bias is None else u_t.bias.detach()

    if distributed.is_dtensor(u_s.weight) and u_s.weight.device_mesh.ndim != 1:
        raise NotImplementedError(
            f"the student's lm_head is sharded over a {u_s.weight.device_mesh.ndim}-D device mesh (HSDP, or FSDP2 with "
            f"tensor parallelism): nitrobrew.hf takes FSDP2 over a 1-D mesh (fully_shard with its default mesh). A "
            f"teacher may use any mesh: its lm_head is gathered")
    _warn_if_autocast_is_skipped(student)

    def student_loss(input_ids, attention_mask):  # the student's forward, inside its wrapper
        h_s = _final_hidden_states(s_inner, input_ids, attention_mask)[:, :-1]
        w_s, wt, b_t = u_s.weight, w_t, bias_t
        if _teacher_gathered(w_s, wt):
            with torch.no_grad():
                wt = wt.full_tensor()
                b_t = b_t.full_tensor() if distributed.is_dtensor(b_t) else b_t
        if distributed.is_dtensor(w_s) and w_s.dtype != h_s.dtype:
            w_s = w_s.to(h_s.dtype)  # FSDP2 mixed precision: float32 shards, 16-bit activations
        options = dict(temperature=temperature, reduction=reduction, labels=targets, ignore_index=ignore_index,
                       ce_weight=ce_weight, vocab_size=vocab_size, bias_s=u_s.bias,
                       bias_t=None if b_t is None else b_t.to(h_s.dtype), logit_scale_s=u_s.scale,
                       logit_scale_t=u_t.scale, softcap_s=u_s.softcap, softcap_t=u_t.softcap,
                       grad_in_forward=grad_in_forward, grad_chunk_mib=grad_chunk_mib)
        return getattr(fused_linear, loss)(h_s, h_t.to(h_s.dtype), w_s, wt.to(h_s.dtype), **weight, **options)

    return _hf_wrappers.run_through(s_wrapper, s_inner, student_loss, input_ids, attention_mask)


def _teacher_gathered(w_s, w_t) -> bool:
    """Whether a sharded teacher's lm_head is gathered for the loss: unless the student's is sharded the same way
    (one 1-D mesh, the same rows), which the DTensor path takes as it is. Beside a whole student's, over another
    mesh (HSDP, or another mesh object), or with other rows (a padded vocabulary) it is gathered."""
    if not distributed.is_dtensor(w_t):
        return False
    return not (distributed.is_dtensor(w_s) and w_t.device_mesh.ndim == 1 and w_t.device_mesh == w_s.device_mesh
                and w_t.shape[0] == w_s.shape[0] and w_t.placements == w_s.placements)


_WARNED_AUTOCAST = False


def _autocast_on() -> bool:
    try:  # torch >= 2.4 takes the device type
        return any(torch.is_autocast_enabled(device) for device in ("cuda", "cpu", "xpu"))
    except (TypeError, RuntimeError):
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _warn_if_autocast_is_skipped(model) -> None:
    """accelerate's mixed precision wraps the prepared model's forward in autocast; nitrobrew.hf runs the decoder
    without that forward, so the caller must enter autocast itself (once a process)."""
    global _WARNED_AUTOCAST
    if _WARNED_AUTOCAST or _autocast_on():
        return
    if any(hasattr(m, "_original_forward") for m in _hf_wrappers.chain(model)):
        import warnings

        _WARNED_AUTOCAST = True
        warnings.warn("nitrobrew.hf: the student's forward is wrapped for mixed precision (accelerate), which "
                      "nitrobrew.hf runs around: call distillation_loss under accelerator.autocast() (or torch.autocast) "
                      "for the forward in 16 bits", stacklevel=3)


def teacher_topk(teacher, input_ids: Tensor, k: int, *, attention_mask: Tensor | None = None,
                 temperature: float = 1.0, vocab_size: int | None = None, check: bool = True,
                 return_stats: bool = False):
    """A Hugging Face causal LM's top-K log-probabilities at every position that distillation_loss scores,
    without its [B, T, V] logits: the decoder runs without its lm_head under torch.no_grad(), and
    nitrobrew.topk_logprobs walks the vocabulary with the model's own transform (lm_head bias, logit scale,
    soft-cap; checked once against the model's logits when `check`).

    Returns (logprobs, ids), each [B, T - 1, k] (float32 and int64), aligned with the shifted positions:
    entry n is the teacher's distribution of token n + 1 given tokens 0..n, what nitrobrew.topk_kl takes as
    teacher_logprobs and teacher_ids for the student's hidden states [:, :-1]. Positions that are not scored
    (scored_labels(input_ids, attention_mask) gives ignore_index there) are computed all the same; pass those
    labels to topk_kl to skip them. With return_stats also each position's log-normalizer and entropy
    [B, T - 1]. temperature divides the teacher's logits; vocab_size: the real vocabulary when the lm_head
    has padding rows."""
    _checks.tensor(input_ids, "input_ids")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [B, T] with T >= 2 (a position and its next token), "
                         f"got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    u = unembedding(teacher)
    if check:
        _check_against_own_logits(teacher, u, input_ids)
    wrapper, inner = _hf_wrappers.split(teacher)
    with torch.no_grad():
        h = _hf_wrappers.run_through(wrapper, inner, _final_hidden_states, inner, input_ids, attention_mask)[:, :-1]
        # A sharded lm_head is gathered: the top-K walk takes whole weights.
        weight, bias = (t.full_tensor() if distributed.is_dtensor(t) else t for t in (u.weight, u.bias))
        return topk_logprobs(h, weight.to(h.dtype), k, temperature=temperature, bias=bias, logit_scale=u.scale,
                             softcap=u.softcap, vocab_size=vocab_size, return_stats=return_stats)
