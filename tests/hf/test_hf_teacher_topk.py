"""nitrobrew.hf.teacher_topk against the top-K of the teacher's own `.logits` (materialized, float64), and
lined up with what distillation_loss and topk_kl score. Skipped without transformers."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
from test_hf import V, batch, halving_its_logits, tiny

pytest.importorskip("transformers")


@pytest.mark.parametrize("family", ["llama", "gemma2", "cohere", "granite", "phi", "qwen2"])
def test_equals_the_top_k_of_the_model_s_own_logits(family):
    # Each family's transform (soft-cap, logit scale, lm_head bias, tied embeddings), at a temperature.
    teacher = tiny(family, hidden=48, seed=3)
    input_ids, attention_mask = batch()
    lp, ids, lse, ent = nitrobrew.hf.teacher_topk(teacher, input_ids, 10, attention_mask=attention_mask,
                                                  temperature=0.7, return_stats=True)
    assert lp.shape == ids.shape == (3, 10, 10) and lse.shape == ent.shape == (3, 10)
    with torch.no_grad():
        logits = teacher(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].double() / 0.7
    logp = logits.log_softmax(-1)
    ref_lp, ref_ids = torch.sort(logp, dim=-1, descending=True, stable=True)
    torch.testing.assert_close(lp.double(), ref_lp[..., :10], rtol=0, atol=2e-4)
    torch.testing.assert_close(lp.double(), logp.gather(-1, ids), rtol=0, atol=2e-4)
    gaps = ref_lp[..., :11].diff(dim=-1).abs()
    clear = (gaps > 1e-3) & torch.cat([torch.ones_like(gaps[..., :1], dtype=torch.bool), gaps[..., :-1] > 1e-3], -1)
    assert torch.equal(ids[clear], ref_ids[..., :10][clear]) and clear.float().mean() > 0.5  # where no near-tie
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), rtol=0, atol=2e-4)
    torch.testing.assert_close(ent.double(), -(logp.exp() * logp).sum(-1), rtol=0, atol=2e-4)


def test_lines_up_with_distillation_loss():
    # With K = V the teacher's top-K is its whole distribution: topk_kl on the student's shifted hidden states,
    # with scored_labels, is distillation_loss's forward KL (the same positions and values).
    student, teacher = tiny("llama", hidden=32), tiny("phi", hidden=48, seed=4)
    input_ids, attention_mask = batch()
    lp, ids = nitrobrew.hf.teacher_topk(teacher, input_ids, V, attention_mask=attention_mask, temperature=1.5)
    h = student.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
    labels = nitrobrew.hf.scored_labels(input_ids, attention_mask)
    u = nitrobrew.hf.unembedding(student)
    for reduction in ("mean", "none"):
        ours = nitrobrew.topk_kl(h, u.weight, ids, lp, labels=labels, temperature=1.5, reduction=reduction)
        theirs = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask,
                                                temperature=1.5, reduction=reduction)
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_scored_labels_match_the_causal_shift():
    input_ids, attention_mask = batch()
    labels = nitrobrew.hf.scored_labels(input_ids, attention_mask)
    assert labels.shape == (3, 10)
    assert torch.equal(labels[0], input_ids[0, 1:])
    assert (labels[1, 6:] == -100).all() and (labels[2, :2] == -100).all()
    with pytest.raises(ValueError, match="input_ids must be"):
        nitrobrew.hf.scored_labels(input_ids[0], attention_mask[0])


def test_runs_without_gradients_and_checks_the_transform():
    teacher = tiny("gemma2", hidden=32, seed=5)
    input_ids, _ = batch()
    lp, ids = nitrobrew.hf.teacher_topk(teacher, input_ids, 4)
    assert torch.is_grad_enabled() and all(p.requires_grad for p in teacher.parameters())
    assert not lp.requires_grad and lp.grad_fn is None  # run under no_grad: no graph of the teacher kept
    assert lp.isfinite().all()
    other = halving_its_logits(tiny("llama", hidden=32, seed=8))
    with pytest.raises(ValueError, match="does not know yet"):
        nitrobrew.hf.teacher_topk(other, input_ids, 4)
    nitrobrew.hf.teacher_topk(other, input_ids, 4, check=False)  # the caller's word


def test_bad_arguments():
    teacher = tiny("llama", hidden=32)
    input_ids, attention_mask = batch()
    with pytest.raises(ValueError, match="input_ids must be"):
        nitrobrew.hf.teacher_topk(teacher, input_ids[:, :1], 4)
    with pytest.raises(ValueError, match="attention_mask must have"):
        nitrobrew.hf.teacher_topk(teacher, input_ids, 4, attention_mask=attention_mask[:, :5])
    with pytest.raises(ValueError, match="k must be in"):
        nitrobrew.hf.teacher_topk(teacher, input_ids, V + 1)
