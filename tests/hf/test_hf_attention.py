"""nitrobrew.hf.capture_attention + attention_distillation_loss against the KL of the attention
probabilities that eager attention returns (output_attentions=True), on tiny models built here: values
and the gradient of the student's query and key projections. Skipped without transformers."""

from __future__ import annotations

import pytest
import torch

import nitrobrew

transformers = pytest.importorskip("transformers")


def tiny(hidden, heads, kv_heads, seed, layers=3, implementation="eager"):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=64,
                                      attn_implementation=implementation)
    model = transformers.AutoModelForCausalLM.from_config(config).double()
    with torch.no_grad():  # sharper attention than random init gives
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model


def batch():
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 64, (2, 13), generator=g)
    mask = torch.ones(2, 13, dtype=torch.int64)
    mask[1, 9:] = 0  # right padding
    return input_ids, mask


def kl_of_probabilities(p_s, p_t, mask, kind):
    """Mean forward (or reverse) KL over the kept query rows and the heads, from [B, H, N, N] probabilities."""
    w, o = (p_t, p_s) if kind == "forward" else (p_s, p_t)
    terms = torch.where(w > 0, w * (w.clamp_min(1e-300).log() - o.clamp_min(1e-300).log()), torch.zeros_like(w))
    rows = terms.sum(-1)  # [B, H, N]
    kept = (mask != 0)[:, None, :].expand_as(rows)
    return rows[kept].mean()


@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_equals_the_kl_of_eager_attention_probabilities(kind):
    # Student: 4 query heads over 2 key heads, head dim 8; teacher: 8 over 4, head dim 12 (every second
    # teacher head is matched). Layer map {0: 1, 2: 2}.
    student, teacher = tiny(32, 4, 2, seed=0), tiny(96, 8, 4, seed=1)
    input_ids, mask = batch()
    with nitrobrew.hf.capture_attention(student, [0, 2]) as s, nitrobrew.hf.capture_attention(teacher, [1, 2]) as t:
        out_s = student(input_ids=input_ids, attention_mask=mask, output_attentions=True)
        with torch.no_grad():
            out_t = teacher(input_ids=input_ids, attention_mask=mask, output_attentions=True)
    assert student.config._attn_implementation == "eager"  # restored
    ours = nitrobrew.hf.attention_distillation_loss(s, t, {0: 1, 2: 2}, attention_mask=mask, kind=kind)
    reference = torch.stack([kl_of_probabilities(out_s.attentions[i], out_t.attentions[j][:, ::2], mask, kind)
                             for i, j in {0: 1, 2: 2}.items()]).mean()
    # Eager attention takes its softmax in float32 even for float64 models: agreement to its rounding.
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-9)
    params = [student.model.layers[i].self_attn.q_proj.weight for i in (0, 2)] + \
             [student.model.layers[i].self_attn.k_proj.weight for i in (0, 2)]
    grads = torch.autograd.grad(ours, params, retain_graph=True)
    reference_grads = torch.autograd.grad(reference, params)
    for g, r in zip(grads, reference_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-8)


def test_the_models_own_attention_runs_during_capture():
    # Captured or not, the model's outputs are the same (sdpa here), and the implementation comes back.
    student = tiny(32, 4, 2, seed=0, implementation="sdpa")
    input_ids, mask = batch()
    plain = student(input_ids=input_ids, attention_mask=mask).logits
    with nitrobrew.hf.capture_attention(student, [1]) as s:
        captured = student(input_ids=input_ids, attention_mask=mask).logits
    torch.testing.assert_close(captured, plain)
    assert student.config._attn_implementation == "sdpa" and set(s.layers) == {1}
    assert s.layers[1].query.shape == (2, 4, 13, 8) and s.layers[1].key.shape == (2, 2, 13, 8)


def test_errors():
    student, teacher = tiny(32, 4, 2, seed=0), tiny(48, 6, 2, seed=1)
    input_ids, mask = batch()
    with pytest.raises(ValueError, match=r"layers \[7\] ran no attention"):
        with nitrobrew.hf.capture_attention(student, [7]):
            student(input_ids=input_ids)
    with nitrobrew.hf.capture_attention(student, [0]) as s, nitrobrew.hf.capture_attention(teacher, [0]) as t:
        student(input_ids=input_ids)
        teacher(input_ids=input_ids)
    with pytest.raises(ValueError, match="cannot be matched"):
        nitrobrew.hf.attention_distillation_loss(s, t, {0: 0})
    with pytest.raises(KeyError, match="layer pair 0 -> 1"):
        nitrobrew.hf.attention_distillation_loss(s, t, {0: 1})
    with pytest.raises(ValueError, match="layer_map must pair at least one"):
        nitrobrew.hf.attention_distillation_loss(s, t, {})
