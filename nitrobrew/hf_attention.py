"""Attention distillation on Hugging Face models: capture the post-RoPE queries and keys of chosen layers
during the models' own forward passes, then score student/teacher pairs of layers with attention_kl.

    with nitrobrew.hf.capture_attention(student, layers=[1, 3]) as s, \\
         nitrobrew.hf.capture_attention(teacher, layers=[2, 6]) as t:
        student(input_ids, attention_mask=mask)
        with torch.no_grad():
            teacher(input_ids, attention_mask=mask)
    loss = nitrobrew.hf.attention_distillation_loss(s, t, {1: 2, 3: 6}, attention_mask=mask)

The capture goes through transformers' attention-function registry: the models' attention runs as it
would (the implementation they were set to), and a wrapper keeps each chosen layer's query
[B, H, N, D] and key [B, H_kv, N, D] tensors (views, with their autograd history) and the layer's score
scale. attention_kl reads them in that layout without a copy (layout="bhnd").
"""

from __future__ import annotations

import dataclasses
import sys

import torch
from torch import Tensor

from nitrobrew import _hf_wrappers
from nitrobrew.attention_kl import attention_kl

__all__ = ["CapturedAttention", "capture_attention", "attention_distillation_loss"]

_IMPLEMENTATION = "nitrobrew_capture"
# The active captures, by the id of the config object their model's attention modules read (configs are
# not hashable); an entry lives only inside its `with` block.
_ACTIVE: dict = {}


@dataclasses.dataclass
class CapturedAttention:
    query: Tensor  # [B, H, N_q, D], after RoPE
    key: Tensor  # [B, H_kv, N_k, D], after RoPE
    scaling: float  # the layer's score scale (1/sqrt(D) for most families)


class capture_attention:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Within the block, every forward of `model` records the queries and keys of `layers` (indices of its
    decoder layers) into `self.layers[index]`; the last forward's are kept. The model's attention
    implementation is restored on exit."""

    def __init__(self, model, layers):
        self.model = _hf_wrappers.unwrapped(model)  # DDP's, torch.compile's and PEFT's wrappers
        self.wanted = set(int(i) for i in layers)
        self.layers: dict[int, CapturedAttention] = {}
        self.base = None

    def __enter__(self):
        config = self.model.config
        if id(config) in _ACTIVE:
            raise RuntimeError("capture_attention: this model is already being captured")
        self.base = config._attn_implementation
        name = _register(self.base)
        _ACTIVE[id(config)] = self
        self.model.set_attn_implementation(name)
        return self

    def __exit__(self, *exc):
        config = self.model.config
        _ACTIVE.pop(id(config), None)
        self.model.set_attn_implementation(self.base)
        missing = self.wanted - set(self.layers)
        if exc[0] is None and missing:
            raise ValueError(f"capture_attention: layers {sorted(missing)} ran no attention in the block (the model "
                             f"has {getattr(config, 'num_hidden_layers', '?')} layers)")
        return False


def _register(base: str) -> str:
    """The capturing implementation for models that run `base`: registered as an attention function (the
    wrapper) and as a mask function (base's own), so that the model builds the mask `base` expects."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = f"{_IMPLEMENTATION}_{base}"
    if name not in AttentionInterface._global_mapping:
        if base not in AttentionMaskInterface._global_mapping:
            raise ValueError(f"capture_attention: models running attention {base!r} cannot be captured (transformers "
                             f"has no mask function registered for it)")
        AttentionInterface.register(name, _capturing_attention)
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[base])
    return name


def _base_attention(module, name):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in (None, "eager"):  # each modeling file has its own eager function
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _capturing_attention(module, query, key, value, attention_mask, **kwargs):
    capture = _ACTIVE.get(id(module.config))
    if capture is None:  # a model whose capture ended without restoring (should not happen)
        raise RuntimeError("nitrobrew_capture attention ran outside capture_attention")
    index = getattr(module, "layer_idx", None)
    if index in capture.wanted:
        if getattr(module, "sliding_window", None) or getattr(module.config, "attn_logit_softcapping", None):
            raise ValueError(f"capture_attention: layer {index} uses a sliding window or soft-capped scores, which "
                             f"attention_kl does not model")
        capture.layers[index] = CapturedAttention(query, key, float(kwargs.get("scaling") or module.scaling))
    return _base_attention(module, capture.base)(module, query, key, value, attention_mask, **kwargs)


def _matching_heads(teacher: CapturedAttention, heads: int) -> tuple[Tensor, Tensor]:
    """The teacher's query and key heads for `heads` student heads: all of them, or every (H_t / H_s)-th
    query head with its key head when the teacher has more."""
    h_t, h_kv = teacher.query.shape[1], teacher.key.shape[1]
    if h_t == heads:
        return teacher.query, teacher.key
    if h_t % heads != 0:
        raise ValueError(f"the teacher's {h_t} query heads cannot be matched to the student's {heads}: "
                         f"pick heads yourself (h_t must be a multiple of h_s here)")
    chosen = torch.arange(0, h_t, h_t // heads, device=teacher.query.device)
    return teacher.query[:, chosen], teacher.key[:, chosen // (h_t // h_kv)]


def attention_distillation_loss(student: capture_attention, teacher: capture_attention, layer_map: dict, *,
                                attention_mask: Tensor | None = None, kind: str = "forward",
                                temperature: float = 1.0, reduction: str = "mean", causal: bool = True) -> Tensor:
    """The mean over `layer_map`'s pairs {student layer: teacher layer} of attention_kl between the captured
    layers, with each model's own score scale, the causal mask and `attention_mask` [B, N] (padding: masked
    as keys and left out as query rows). Query-head counts must match, or the teacher's must be a multiple
    of the student's (every k-th teacher head is used); key-head counts (GQA) and head dims may differ.
    reduction "none" returns every pair's [B, H, N] losses stacked, [pairs, B, H, N], in layer_map's order."""
    if not layer_map:
        raise ValueError("layer_map must pair at least one student layer with a teacher layer")
    losses = []
    for s_index, t_index in layer_map.items():
        if s_index not in student.layers or t_index not in teacher.layers:
            raise KeyError(f"layer pair {s_index} -> {t_index}: captured student layers {sorted(student.layers)}, "
                           f"teacher layers {sorted(teacher.layers)}")
        s, t = student.layers[s_index], teacher.layers[t_index]
        q_t, k_t = _matching_heads(t, s.query.shape[1])
        losses.append(attention_kl(s.query, s.key, q_t.to(s.query.dtype), k_t.to(s.query.dtype), kind=kind,
                                   causal=causal, scale_s=s.scaling, scale_t=t.scaling, temperature=temperature,
                                   reduction=reduction, attention_mask=attention_mask, query_mask=attention_mask,
                                   layout="bhnd"))
    return torch.stack(losses).mean(0) if reduction != "none" else torch.stack(losses)
