"""nitrobrew.hf.distillation_loss on models wrapped in DistributedDataParallel or sharded with FSDP2, over two
gloo ranks on CPU (float64), each rank with its own tokens: the loss and every student parameter's gradient
equal the single-process result (each rank's loss from the plain models' own logits, the gradients averaged
over the ranks as DDP and FSDP2 average them, or the rank's own for a plain student). The vocabulary (96 rows over 2 ranks, and 67 rows: shards of 34
and 33) is sharded with the lm_head. Skipped without transformers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import nitrobrew

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from rank_processes import ranks_on_the_gpu, run_on_ranks  # noqa: E402
from test_hf import reference_loss, tiny  # noqa: E402

WORLD = 2
# (student's wrapping, teacher's wrapping). fsdp2: the layers and the root sharded (lm_head in the root's group,
# as fully_shard(model) leaves it); fsdp2_head: lm_head (with the input embedding when tied) a unit of its own,
# the zero-gather layout.
LAYOUTS = [("fsdp2", "fsdp2"), ("fsdp2_head", "fsdp2_head"), ("fsdp2", "plain"), ("ddp", "fsdp2"), ("ddp", "plain"),
           ("plain", "fsdp2_head")]


def _wrap(model, layout):
    if layout == "plain":
        return model
    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if layout == "fsdp2_head":
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        fully_shard([embed, head] if head.weight is embed.weight else head)
    fully_shard(model)
    return model


def _grads(model):
    """{name: the whole gradient} of a wrapped model's parameters (an FSDP2 shard's gathered)."""
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    out = {}
    for name, p in module.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _batch(rank, vocab):
    g = torch.Generator().manual_seed(100 + rank)
    input_ids = torch.randint(0, vocab, (2, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    labels = input_ids.clone()
    labels[:, :3] = -100  # the prompt
    labels[attention_mask == 0] = -100
    return input_ids, attention_mask, labels


def _matches_single_process(rank, world, family, vocab, device="cpu", dtype=torch.float64):
    """The wrapped models in `dtype` against the float64 reference on the same device: on the CPU in float64
    (gloo), over NCCL on each rank's GPU in float32 (CUDA runs no float64), to float32's precision."""
    import torch.distributed as dist

    device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    if dtype == torch.float64:
        tol, grad_tol = dict(rtol=1e-9, atol=1e-12), dict(rtol=1e-7, atol=1e-10)
    else:
        tol, grad_tol = dict(rtol=1e-4, atol=1e-6), dict(rtol=1e-3, atol=1e-6)
    input_ids, attention_mask, labels = (t.to(device) for t in _batch(rank, vocab))
    for s_layout, t_layout in LAYOUTS:
        for loss, ce_weight in (("forward_kl", 0.5), ("jsd", 0.0)):
            def models(dtype):
                return (tiny(family, hidden=32, vocab=vocab).to(device, dtype),
                        tiny(family, hidden=48, vocab=vocab, seed=1).to(device, dtype))

            ref_student, ref_teacher = models(torch.float64)
            ref = reference_loss(ref_student, ref_teacher, input_ids, attention_mask=attention_mask, labels=labels,
                                 loss=loss, ce_weight=ce_weight)
            ref.backward()
            ref_grads = {}
            for name, p in ref_student.named_parameters():  # averaged over the ranks, but by a plain student
                if s_layout != "plain":
                    dist.all_reduce(p.grad)
                    p.grad /= world
                ref_grads[name] = p.grad.to(dtype)
            student, teacher = (_wrap(m, layout) for m, layout in zip(models(dtype), (s_layout, t_layout)))
            for step in range(2):  # the first step checks the models against their own logits
                for p in student.parameters():
                    p.grad = None
                value = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask,
                                                       labels=labels, loss=loss, ce_weight=ce_weight)
                value.backward()
                where = f"{family} V={vocab} {s_layout}/{t_layout} {loss} step {step} rank {rank}"
                torch.testing.assert_close(value.detach(), ref.detach().to(dtype), **tol,
                                           msg=lambda m: f"{where}: {m}")
                grads = _grads(student)
                assert grads.keys() == ref_grads.keys(), where
                for name, g in ref_grads.items():
                    torch.testing.assert_close(grads[name], g, **grad_tol, msg=lambda m, name=name: f"{where} {name}: {m}")
            assert not any(p.grad is not None for p in teacher.parameters()), where


@pytest.mark.parametrize("family,vocab", [("llama", 67), ("qwen2", 96), ("gemma2", 67)])
def test_loss_and_gradients_equal_the_single_process_ones(family, vocab):
    """Llama (untied), Qwen2 (tied embeddings) and Gemma-2 (tied, soft-cap): every pairing of FSDP2, DDP and
    plain models in LAYOUTS, forward KL with cross-entropy and JSD, a masked prompt and padding."""
    run_on_ranks(WORLD, _matches_single_process, family, vocab)


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")
@pytest.mark.parametrize("family,vocab", [("llama", 67), ("qwen2", 96), ("gemma2", 67)])
def test_loss_and_gradients_over_nccl_cuda(family, vocab, monkeypatch):
    """The same pairings over NCCL, a GPU a rank, float32: the CUDA kernels on DTensor shards."""
    ranks_on_the_gpu(monkeypatch)
    run_on_ranks(WORLD, _matches_single_process, family, vocab, "cuda", torch.float32, backend="nccl")


def _refuses_unsharded_roots(rank, world):
    from torch.distributed.fsdp import fully_shard

    student = tiny("llama", hidden=32).double()
    for layer in student.model.layers:
        fully_shard(layer)
    input_ids, attention_mask, _ = _batch(rank, 96)
    with pytest.raises(ValueError, match="not fully_shard-ed itself.*shard the root"):
        nitrobrew.hf.distillation_loss(student, tiny("llama", hidden=48).double(), input_ids,
                                       attention_mask=attention_mask)


def test_layers_sharded_without_the_root_are_refused():
    run_on_ranks(WORLD, _refuses_unsharded_roots)


def _catches_an_unknown_transform_on_every_rank(rank, world):
    student = _wrap(tiny("llama", hidden=32).double(), "fsdp2_head")
    teacher = tiny("llama", hidden=48).double()
    # A logit transform nitrobrew cannot know: an offset of the logits, on the sharded teacher's lm_head.
    teacher.lm_head.register_forward_hook(lambda module, args, out: out + 1.5)
    teacher = _wrap(teacher, "fsdp2_head")
    input_ids, attention_mask, _ = _batch(rank, 96)
    # The sharded student passes its check (each rank on its rows of the vocabulary); the teacher fails on every
    # rank together, with the largest error of any rank.
    with pytest.raises(ValueError, match="LlamaForCausalLM: its logits are not.*max difference 1.5"):
        nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask)


def test_the_check_runs_on_sharded_models():
    run_on_ranks(WORLD, _catches_an_unknown_transform_on_every_rank)


def _teacher_topk_matches(rank, world):
    input_ids, attention_mask, _ = _batch(rank, 67)
    plain = tiny("qwen2", hidden=48, vocab=67, seed=1).double()
    expected = nitrobrew.hf.teacher_topk(plain, input_ids, 5, attention_mask=attention_mask, return_stats=True)
    for layout in ("fsdp2", "fsdp2_head", "ddp"):
        teacher = _wrap(tiny("qwen2", hidden=48, vocab=67, seed=1).double(), layout)
        got = nitrobrew.hf.teacher_topk(teacher, input_ids, 5, attention_mask=attention_mask, return_stats=True)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=f"{layout} rank {rank}")


def test_teacher_topk_on_sharded_and_ddp_teachers():
    """teacher_topk of a wrapped teacher (its sharded lm_head gathered) equals the plain teacher's."""
    run_on_ranks(WORLD, _teacher_topk_matches)


def _attention_loss_matches(rank, world):
    import torch.distributed as dist

    input_ids, attention_mask, labels = _batch(rank, 96)
    layer_map = {0: 1, 1: 0}

    def step(student, teacher):
        with nitrobrew.hf.capture_attention(student, layer_map.keys()) as s, \
                nitrobrew.hf.capture_attention(teacher, layer_map.values()) as t:
            logit_loss = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask,
                                                        labels=labels)
        return logit_loss + 0.5 * nitrobrew.hf.attention_distillation_loss(s, t, layer_map,
                                                                           attention_mask=attention_mask)

    def models():
        return tiny("llama", hidden=32).double(), tiny("llama", hidden=32, seed=1).double()

    ref_student, ref_teacher = models()
    ref = step(ref_student, ref_teacher)
    ref.backward()
    ref_grads = {}
    for name, p in ref_student.named_parameters():
        dist.all_reduce(p.grad)
        ref_grads[name] = p.grad / world
    for layout in ("fsdp2", "ddp"):
        student, teacher = models()
        student, teacher = _wrap(student, layout), _wrap(teacher, "fsdp2")
        value = step(student, teacher)
        value.backward()
        torch.testing.assert_close(value.detach(), ref.detach(), rtol=1e-9, atol=1e-12, msg=f"{layout} rank {rank}")
        grads = _grads(student)
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-7, atol=1e-10, msg=f"{layout} {name} rank {rank}")


def test_attention_distillation_on_sharded_and_ddp_models():
    """The attention-map KL (queries and keys captured while distillation_loss runs the decoders inside their
    wrappers) plus the logit loss: values and gradients equal the single-process ones under FSDP2 and DDP."""
    run_on_ranks(WORLD, _attention_loss_matches)


def _mixed_precision_runs(rank, world):
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    input_ids, attention_mask, labels = _batch(rank, 96)
    ref_student, ref_teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=1)
    ref = reference_loss(ref_student, ref_teacher, input_ids, attention_mask=attention_mask, labels=labels)
    ref.backward()
    for p in ref_student.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    student, teacher = tiny("llama", hidden=32), tiny("llama", hidden=48, seed=1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in student.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(student.lm_head, mp_policy=policy)
    fully_shard(student, mp_policy=policy)
    teacher = _wrap(teacher, "fsdp2")
    value = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask, labels=labels)
    value.backward()
    # bf16 activations and weights inside the forward: the loss and gradients to bf16's precision.
    torch.testing.assert_close(value.detach().double(), ref.detach().double(), rtol=3e-2, atol=1e-3)
    grads = _grads(student)
    for name, p in ref_student.named_parameters():
        g = grads[name].double()
        assert g.dtype == torch.float64 and grads[name].dtype == torch.float32, name  # the float32 master's
        err = (g - p.grad.double()).norm() / p.grad.double().norm().clamp(min=1e-12)
        assert err < 5e-2, f"{name}: relative error {err:.3g} rank {rank}"


def test_fsdp2_mixed_precision_student():
    """FSDP2's MixedPrecisionPolicy (bf16 parameters in the forward, float32 shards and reductions): the sharded
    float32 lm_head is cast to the activations' dtype; the loss and gradients match float32 to bf16's precision."""
    run_on_ranks(WORLD, _mixed_precision_runs)


def _wrapper_chains_match(rank, world):
    """The orders accelerate and TRL wrap in: torch.compile around FSDP2 or DDP, FSDP2 around a compiled model,
    FSDP2 with a PeftModel as its root."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    input_ids, attention_mask, _ = _batch(rank, 67)

    def models(lora=False):
        student = tiny("llama", hidden=32, vocab=67).double()
        if lora:
            import peft

            student = peft.get_peft_model(student, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                   init_lora_weights=False))
        return student, tiny("llama", hidden=48, vocab=67, seed=1).double()

    def trainable_grads(model):
        return {n.replace("base_model.model.", "").replace("_orig_mod.", "").replace("module.", ""): g
                for n, g in _grads(model).items()}

    for order in ("compile(fsdp2)", "fsdp2(compile)", "compile(ddp)", "fsdp2(peft)"):
        ref_student, ref_teacher = models(lora=order == "fsdp2(peft)")
        ref = nitrobrew.hf.distillation_loss(ref_student, ref_teacher, input_ids, attention_mask=attention_mask)
        ref.backward()
        want = {}
        for name, p in trainable_grads(ref_student).items():
            dist.all_reduce(p)
            want[name] = p / world
        student, teacher = models(lora=order == "fsdp2(peft)")
        if order == "compile(ddp)":
            student = torch.compile(torch.nn.parallel.DistributedDataParallel(student), backend="eager")
        else:
            layers = (student.base_model.model if order == "fsdp2(peft)" else student).model.layers
            for layer in layers:
                fully_shard(layer)
            if order == "compile(fsdp2)":
                fully_shard(student)
                student = torch.compile(student, backend="eager")
            elif order == "fsdp2(compile)":
                student = torch.compile(student, backend="eager")
                fully_shard(student)
            else:
                fully_shard(student)
        for step in range(2):
            for p in student.parameters():
                p.grad = None
            value = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask)
            value.backward()
            where = f"{order} step {step} rank {rank}"
            torch.testing.assert_close(value.detach(), ref.detach(), rtol=1e-9, atol=1e-12, msg=where)
            got = trainable_grads(student)
            assert got.keys() == want.keys(), (where, sorted(got), sorted(want))
            for name, g in want.items():
                torch.testing.assert_close(got[name], g, rtol=1e-7, atol=1e-10, msg=f"{where} {name}")


def test_wrapper_chains_of_accelerate_and_trl():
    pytest.importorskip("peft")
    run_on_ranks(WORLD, _wrapper_chains_match)


def _hsdp_and_padded_vocabularies(rank, world):
    """Over 4 ranks: an HSDP (2 x 2 mesh) teacher beside a plain student and in teacher_topk equals the plain
    teacher; an HSDP student is refused saying what nitrobrew.hf takes; two FSDP2 lm_heads of different row
    counts (a padded teacher) give the single-process result (the teacher's is gathered)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    input_ids, attention_mask, _ = _batch(rank, 67)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def hsdp(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    student, teacher = tiny("llama", hidden=32, vocab=67).double(), tiny("llama", hidden=48, vocab=67, seed=1).double()
    ref = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask)
    ref_topk = nitrobrew.hf.teacher_topk(teacher, input_ids, 3, attention_mask=attention_mask)
    sharded_teacher = hsdp(tiny("llama", hidden=48, vocab=67, seed=1).double())
    got = nitrobrew.hf.distillation_loss(student, sharded_teacher, input_ids, attention_mask=attention_mask)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    for a, b in zip(nitrobrew.hf.teacher_topk(sharded_teacher, input_ids, 3, attention_mask=attention_mask), ref_topk):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    with pytest.raises(NotImplementedError, match="2-D device mesh.*1-D mesh"):
        nitrobrew.hf.distillation_loss(hsdp(tiny("llama", hidden=32, vocab=67).double()), teacher, input_ids)

    # A teacher padded to 72 rows beside a student of 67, both sharded over the 4 ranks.
    padded = tiny("llama", hidden=48, vocab=72, seed=1).double()
    ref_student = tiny("llama", hidden=32, vocab=67).double()
    ref = nitrobrew.hf.distillation_loss(ref_student, padded, input_ids, attention_mask=attention_mask, vocab_size=67)
    student, teacher = (_wrap(m, "fsdp2_head") for m in (tiny("llama", hidden=32, vocab=67).double(),
                                                         tiny("llama", hidden=48, vocab=72, seed=1).double()))
    got = nitrobrew.hf.distillation_loss(student, teacher, input_ids, attention_mask=attention_mask, vocab_size=67)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)


def test_hsdp_teachers_and_padded_vocabularies():
    run_on_ranks(4, _hsdp_and_padded_vocabularies)
