"""nitrobrew.hf against the same loss computed from the models' own `.logits` with Hugging Face's causal
shift: values and student-parameter gradients, on tiny models built here (no hub downloads). Skipped
without transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nitrobrew
from nitrobrew import reference

transformers = pytest.importorskip("transformers")

V = 96
BETAS = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.4}
NEW_LOSSES = ["skew_forward_kl", "skew_reverse_kl", "tvd"]


def tiny(family: str, *, hidden: int, vocab: int = V, seed: int = 0, **extra):
    """A randomly initialized causal LM of `family` with 2 layers."""
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, **extra),
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True, **extra),
        "gemma2": lambda: transformers.Gemma2Config(**common, head_dim=hidden // 4, final_logit_softcapping=3.0,
                                                    **extra),
        "cohere": lambda: transformers.CohereConfig(**common, logit_scale=0.5, **extra),
        "granite": lambda: transformers.GraniteConfig(**common, logits_scaling=4.0, **extra),
        "phi": lambda: transformers.PhiConfig(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                                              **extra),
    }
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs[family]())
    with torch.no_grad():  # logits of a useful spread (random init gives nearly uniform distributions)
        head = model.get_output_embeddings()
        head.weight.mul_(8.0)
        if head.bias is not None:  # initialized to zeros: give it logits' worth of spread
            head.bias.normal_(0.0, 2.0)
    return model.float()


def batch(b=3, t=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (b, t), generator=g)
    attention_mask = torch.ones(b, t, dtype=torch.int64)
    attention_mask[1, 7:] = 0  # right padding
    attention_mask[2, :3] = 0  # left padding
    return input_ids, attention_mask


def reference_loss(student, teacher, input_ids, *, attention_mask=None, labels=None, loss="forward_kl", beta=0.5,
                   alpha=0.1, temperature=1.0, reduction="mean", ce_weight=0.0, vocab_size=None, ignore_index=-100):
    """The loss from the models' own logits (materialized), in float64, with the causal shift."""
    zs = student(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].double()
    with torch.no_grad():
        zt = teacher(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].double()
    if vocab_size is not None:
        zs, zt = zs[..., :vocab_size], zt[..., :vocab_size]
    if labels is not None:
        targets = labels[:, 1:]
    elif attention_mask is not None:
        targets = torch.where(attention_mask[:, 1:] != 0, input_ids[:, 1:], ignore_index)
    else:
        targets = input_ids[:, 1:]
    b = beta if loss == "jsd" else alpha if loss.startswith("skew_") else BETAS.get(loss, 0.0)
    rows = reference.logits(zs, zt, beta=b, divergence=loss, temperature=temperature, reduction="none",
                            labels=targets, ignore_index=ignore_index, dtype=None)
    if ce_weight:
        ce = F.cross_entropy(zs.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="none")
        rows = rows + ce_weight * ce.view_as(rows)
    scored = targets != ignore_index
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / scored.sum().clamp(min=1)


def values_and_grads(fn, student):
    student.zero_grad(set_to_none=True)
    value = fn()
    (value if value.dim() == 0 else value.sum()).backward()
    return value.detach().double(), {n: p.grad.detach().clone() for n, p in student.named_parameters()
                                     if p.grad is not None}


def assert_same(ours, theirs, rtol=2e-4, atol=2e-6):
    (v_ours, g_ours), (v_ref, g_ref) = ours, theirs
    torch.testing.assert_close(v_ours, v_ref, rtol=rtol, atol=atol)
    assert g_ours.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g_ours[name].double(), g_ref[name].double(), rtol=rtol, atol=atol * 10,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "cohere", "granite", "phi"])
@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
def test_equals_the_loss_from_the_models_own_logits(family, loss):
    student, teacher = tiny(family, hidden=32), tiny(family, hidden=64, seed=1)
    input_ids, attention_mask = batch()
    options = dict(attention_mask=attention_mask, loss=loss, temperature=1.5)
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids, **options), student)
    theirs = values_and_grads(lambda: reference_loss(student, teacher, input_ids, **options), student)
    assert_same(ours, theirs)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
@pytest.mark.parametrize("loss", NEW_LOSSES)
def test_skew_kls_and_tvd_equal_the_loss_from_the_models_own_logits(family, loss):
    student, teacher = tiny(family, hidden=32), tiny(family, hidden=64, seed=1)
    input_ids, attention_mask = batch()
    weight = {} if loss == "tvd" else {"alpha": 0.3}
    options = dict(attention_mask=attention_mask, loss=loss, temperature=1.5, **weight)
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids, **options), student)
    theirs = values_and_grads(lambda: reference_loss(student, teacher, input_ids, **options), student)
    assert_same(ours, theirs)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_labels_ce_weight_and_reductions(reduction):
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=2)
    input_ids, attention_mask = batch()
    labels = input_ids.clone()
    labels[0, :4] = -100  # a prompt that is not scored
    labels[attention_mask == 0] = -100
    options = dict(attention_mask=attention_mask, labels=labels, ce_weight=0.3, reduction=reduction)
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids, **options), student)
    theirs = values_and_grads(lambda: reference_loss(student, teacher, input_ids, **options), student)
    assert_same(ours, theirs)
    if reduction == "none":
        assert ours[0].shape == (3, 10) and (ours[0][labels[:, 1:] == -100] == 0).all()


def test_without_a_mask_every_position_but_the_last_is_scored():
    student, teacher = tiny("qwen2", hidden=32), tiny("qwen2", hidden=32, seed=3)
    input_ids, _ = batch()
    rows = nitrobrew.hf.distillation_loss(student, teacher, input_ids, reduction="none")
    assert rows.shape == (3, 10) and (rows > 0).all()
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids), student)
    theirs = values_and_grads(lambda: reference_loss(student, teacher, input_ids), student)
    assert_same(ours, theirs)


def test_padded_vocabularies_need_vocab_size():
    student, teacher = tiny("llama", hidden=32, vocab=V + 8), tiny("llama", hidden=32, seed=4)
    input_ids, attention_mask = batch()
    with pytest.raises(ValueError, match="pass vocab_size"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids)
    options = dict(attention_mask=attention_mask, vocab_size=V)
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids, **options), student)
    theirs = values_and_grads(lambda: reference_loss(student, teacher, input_ids, **options), student)
    assert_same(ours, theirs)


def test_gradient_checkpointing():
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=5)
    input_ids, attention_mask = batch()
    plain = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids,
                                                                    attention_mask=attention_mask), student)
    (getattr(student, "activation_checkpointing_enable", None) or student.gradient_checkpointing_enable)()
    student.train()
    checkpointed = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids,
                                                                           attention_mask=attention_mask), student)
    assert_same(checkpointed, plain, rtol=1e-5, atol=1e-7)


def test_teacher_gets_no_gradient():
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=6)
    input_ids, _ = batch()
    nitrobrew.hf.distillation_loss(student, teacher, input_ids).backward()
    assert all(p.grad is None for p in teacher.parameters())


@pytest.mark.parametrize("family", ["cohere", "granite"])
def test_logit_scales_are_read_from_the_config(family):
    model = tiny(family, hidden=32)
    u = nitrobrew.hf.unembedding(model)
    assert u.scale == (0.5 if family == "cohere" else 0.25) and u.bias is None and u.softcap is None
    input_ids, _ = batch()
    h = model.get_decoder()(input_ids=input_ids).last_hidden_state
    torch.testing.assert_close(u.scale * (h @ u.weight.T), model(input_ids=input_ids).logits)


def test_lm_head_biases_are_read_and_trained():
    model = tiny("phi", hidden=32)
    u = nitrobrew.hf.unembedding(model)
    assert u.bias is model.get_output_embeddings().bias and u.bias.abs().max() > 1
    student, teacher = model, tiny("phi", hidden=48, seed=7)
    input_ids, attention_mask = batch()
    nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask).backward()
    assert u.bias.grad is not None and u.bias.grad.abs().max() > 0


@pytest.mark.parametrize("student_family, teacher_family", [("phi", "cohere"), ("granite", "gemma2"),
                                                            ("llama", "phi")])
def test_pairs_of_different_families(student_family, teacher_family):
    # Each side's own transform (bias, logit scale, soft-cap), the student's gradients through it.
    student, teacher = tiny(student_family, hidden=32), tiny(teacher_family, hidden=48, seed=10)
    input_ids, attention_mask = batch()
    options = dict(attention_mask=attention_mask, loss="jsd", beta=0.3, temperature=0.8)
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids, **options), student)
    theirs = values_and_grads(lambda: reference_loss(student, teacher, input_ids, **options), student)
    assert_same(ours, theirs)


def halving_its_logits(model):
    """`model`, now a family that halves its logits without saying so in its config."""
    original = type(model).forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        out.logits = out.logits / 2
        return out

    model.forward = forward.__get__(model)
    return model


def test_an_unknown_logit_transform_is_caught_by_the_check():
    student, teacher = tiny("llama", hidden=32), halving_its_logits(tiny("llama", hidden=32, seed=8))
    with pytest.raises(ValueError, match="does not know yet"):
        nitrobrew.hf.distillation_loss(student, teacher, batch()[0])


def test_bad_arguments():
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=32, seed=9)
    input_ids, attention_mask = batch()
    with pytest.raises(ValueError, match="loss must be one of"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, loss="kl")
    with pytest.raises(ValueError, match="alpha is the weight of 'skew_forward_kl' and 'skew_reverse_kl' only"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, loss="jsd", alpha=0.3)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\] with T >= 2"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids[:, :1])
    with pytest.raises(ValueError, match="attention_mask must have input_ids' shape"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask[:, :5])
    with pytest.raises(ValueError, match="labels must have input_ids' shape"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, labels=input_ids[:, 1:])
    with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, labels=[1, 2])
    with pytest.raises(ValueError, match="no linear output embedding"):
        nitrobrew.hf.unembedding(torch.nn.Linear(3, 4))
    with pytest.raises(ValueError, match="grad_chunk_mib must be a positive int"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, grad_chunk_mib=0)
    with pytest.raises(TypeError, match="grad_in_forward must be None"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, grad_in_forward="yes")


def test_the_training_path_options_reach_the_loss():
    # grad_chunk_mib bounds the training path's chunks: the same loss and gradients from one chunk and many.
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=12)
    input_ids, attention_mask = batch()
    runs = [values_and_grads(lambda: nitrobrew.hf.distillation_loss(student, teacher, input_ids,
                                                                    attention_mask=attention_mask, **kw), student)
            for kw in (dict(grad_in_forward=False), dict(grad_in_forward=True, grad_chunk_mib=1))]
    assert_same(*runs)


def test_a_compiled_student():
    # torch.compile(student) wraps the model; nitrobrew.hf reads the unembedding and runs the decoder of
    # the model underneath.
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=10)
    input_ids, attention_mask = batch()
    compiled = torch.compile(student)
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(compiled, teacher, input_ids,
                                                                   attention_mask=attention_mask), student)
    theirs = values_and_grads(lambda: reference_loss(student, teacher, input_ids, attention_mask=attention_mask),
                              student)
    assert_same(ours, theirs)


def test_a_peft_lora_student():
    peft = pytest.importorskip("peft")
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=11)
    input_ids, attention_mask = batch()
    lora = peft.get_peft_model(student, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ours = values_and_grads(lambda: nitrobrew.hf.distillation_loss(lora, teacher, input_ids,
                                                                   attention_mask=attention_mask), lora)
    theirs = values_and_grads(lambda: reference_loss(lora, teacher, input_ids, attention_mask=attention_mask), lora)
    assert_same(ours, theirs)
    assert any("lora" in name for name in ours[1])
    adapted_head = peft.get_peft_model(tiny("llama", hidden=32), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="the lm_head itself is adapted"):
        nitrobrew.hf.distillation_loss(adapted_head, teacher, input_ids)


def test_trl_gkd_trainer_gives_trl_s_loss():
    # nitrobrew.trl.GKDTrainer.compute_loss against TRL's own on the same batch, with and without
    # num_items_in_batch; the trainer's state that compute_loss reads is set by hand (a full trainer
    # needs a tokenizer and a dataset, which a hub-free test has not).
    pytest.importorskip("trl")
    import types

    from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer

    from nitrobrew.trl import GKDTrainer

    student, teacher = tiny("qwen2", hidden=32), tiny("qwen2", hidden=64, seed=12)
    input_ids, attention_mask = batch()
    labels = input_ids.clone()
    labels[:, :4] = -100  # the prompt
    labels[attention_mask == 0] = -100
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    for beta in (0.0, 0.3, 1.0):
        for items in (None, torch.tensor(40)):
            state = types.SimpleNamespace(teacher_model=teacher, beta=beta, nitrobrew_divergence="jsd",
                                          nitrobrew_alpha=0.1, accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
                                          generalized_jsd_loss=TRLGKDTrainer.generalized_jsd_loss)
            ours = values_and_grads(lambda: GKDTrainer.compute_loss(state, student, inputs,
                                                                    num_items_in_batch=items), student)
            theirs = values_and_grads(lambda: TRLGKDTrainer.compute_loss(state, student, inputs,
                                                                         num_items_in_batch=items), student)
            assert_same(ours, theirs)


@pytest.mark.parametrize("beta, temperature, families", [(0.0, 1.0, ("llama", "llama")), (0.5, 2.0, ("llama", "llama")),
                                                         (1.0, 1.0, ("llama", "llama")), (0.5, 1.5, ("phi", "cohere")),
                                                         (0.2, 1.0, ("granite", "phi"))])
def test_trl_distillation_trainer_gives_trl_s_loss(beta, temperature, families):
    # nitrobrew.trl.DistillationTrainer._compute_loss against TRL's on the same prompts and completions,
    # with the trainer's state that _compute_loss reads set by hand (a full trainer generates).
    pytest.importorskip("trl")
    import types

    from trl import DistillationTrainer as TRLDistillationTrainer

    from nitrobrew.trl import DistillationTrainer

    student, teacher = tiny(families[0], hidden=32), tiny(families[1], hidden=64, seed=13)
    input_ids, attention_mask = batch()
    inputs = dict(prompt_ids=input_ids[:, :4], prompt_mask=attention_mask[:, :4], completion_ids=input_ids[:, 4:],
                  completion_mask=attention_mask[:, 4:])
    state = types.SimpleNamespace(teacher_model=teacher, beta=beta, temperature=temperature, model_kwarg_keys=(),
                                  nitrobrew_divergence="jsd", nitrobrew_alpha=0.1,
                                  _is_vlm=False, accelerator=types.SimpleNamespace(unwrap_model=lambda m: m, is_main_process=True),
                                  _forward_redirection=lambda wrapped, unwrapped, fn, *args, **kw: fn(*args, **kw))
    state._get_last_hidden_state = types.MethodType(TRLDistillationTrainer._get_last_hidden_state, state)
    for items in (None, torch.tensor(30)):
        ours = values_and_grads(lambda: DistillationTrainer._compute_loss(state, student, inputs, items)[0], student)
        theirs = values_and_grads(lambda: TRLDistillationTrainer._compute_loss(state, student, inputs, items)[0],
                                  student)
        assert_same(ours, theirs)
    # The logged student entropy (a sum over the completion tokens, and their count) is TRL's, not NaN: in
    # evaluation (the recompute path) and in training (the training path).
    for mode in (torch.no_grad, torch.enable_grad):
        with mode():
            _, our_entropy, our_count = DistillationTrainer._compute_loss(state, student, inputs, None)
            _, their_entropy, their_count = TRLDistillationTrainer._compute_loss(state, student, inputs, None)
        assert torch.isfinite(our_entropy) and int(our_count) == int(their_count)
        torch.testing.assert_close(our_entropy.double(), their_entropy.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("divergence", ["skew_forward_kl", "skew_reverse_kl", "tvd", "reverse_kl"])
def test_trl_divergence_loss_takes_nitrobrew_s_divergences(divergence):
    # nitrobrew.trl's DistillationTrainer(divergence=...) swaps TRL's chunked loss for this function: its loss
    # over the completion mask, against the reference from materialized logits, with TRL's (loss, entropy, count).
    pytest.importorskip("trl")
    from nitrobrew.trl import _divergence_loss

    g = torch.Generator().manual_seed(5)
    hs, ht = torch.randn(2, 6, 16, generator=g, dtype=torch.float64), torch.randn(2, 6, 24, generator=g,
                                                                                   dtype=torch.float64)
    ws, wt = torch.randn(50, 16, generator=g, dtype=torch.float64), torch.randn(50, 24, generator=g,
                                                                                  dtype=torch.float64)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 4:] = 0
    hs.requires_grad_()
    loss, entropy, count = _divergence_loss(hs, ht, ws, wt, mask, 0.5, temperature=2.0, divergence=divergence,
                                            alpha=0.3)
    labels = torch.where(mask != 0, 0, -100)
    weight = 0.3 if divergence.startswith("skew_") else 0.5
    expected = reference.logits(hs @ ws.T, ht @ wt.T, beta=weight, divergence=divergence, temperature=2.0,
                                labels=labels, reduction="mean")
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    assert int(count) == 10 and torch.isfinite(entropy)


def test_trl_trainers_check_their_divergence():
    pytest.importorskip("trl")
    from nitrobrew.trl import DistillationTrainer, GKDTrainer

    for trainer in (GKDTrainer, DistillationTrainer):
        with pytest.raises(ValueError, match="divergence must be one of"):
            trainer(divergence="kl")
        with pytest.raises(ValueError, match="alpha must be a number in"):
            trainer(divergence="skew_forward_kl", alpha=2.0)


def _word_tokenizer():
    """The word-level tokenizer of examples/distill_trl.py, over V words."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from distill_trl import word_tokenizer

    return word_tokenizer(V)


def test_trl_gkd_trainer_trains_as_trl_s(tmp_path, monkeypatch):
    # A real GKDTrainer run (off-policy, lmbda = 0): nitrobrew's trainer and TRL's log the same losses
    # step by step from the same models and data.
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd import GKDConfig
    from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer

    from nitrobrew.trl import GKDTrainer

    g = torch.Generator().manual_seed(0)

    def words(n):
        return " ".join(f"t{int(i)}" for i in torch.randint(0, V - 6, (n,), generator=g))

    data = datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": words(5)},
                                                     {"role": "assistant", "content": words(7)}] for _ in range(12)]})
    losses = {}
    for name, trainer_class in (("nitrobrew", GKDTrainer), ("trl", TRLGKDTrainer)):
        args = GKDConfig(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=4, lmbda=0.0,
                         beta=0.3, report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, bf16=False,
                         max_length=32, seed=0, disable_tqdm=True)
        trainer = trainer_class(model=tiny("llama", hidden=32), teacher_model=tiny("llama", hidden=64, seed=14),
                                args=args, train_dataset=data, processing_class=_word_tokenizer())
        trainer.train()
        losses[name] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses["trl"]) == 3
    torch.testing.assert_close(torch.tensor(losses["nitrobrew"]), torch.tensor(losses["trl"]), rtol=1e-4, atol=1e-7)


def test_a_forward_wrapped_for_mixed_precision_warns(monkeypatch):
    # accelerate's mixed precision wraps the prepared model's forward (leaving _original_forward), which
    # nitrobrew.hf runs around: a warning says to enter autocast, unless autocast is on.
    import warnings

    from nitrobrew import hf

    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48)
    student._original_forward = student.forward
    input_ids, attention_mask = batch()
    monkeypatch.setattr(hf, "_WARNED_AUTOCAST", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask)
    with pytest.warns(UserWarning, match="accelerator.autocast"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask)
