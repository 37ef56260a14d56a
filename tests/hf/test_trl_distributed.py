"""nitrobrew.trl.GKDTrainer's loss on sharded and DDP students, over two gloo ranks on CPU: equal to TRL's own
GKDTrainer loss on the same wrapped models and batch (values and every student gradient). The student is
wrapped as accelerate wraps it (accelerate's fsdp2_prepare_model with its transformer_based_wrap policy, or
DDP, accelerate's wrapper for several CPU processes), the teacher as TRL's prepare_fsdp shards it (the root
alone) or plain. Skipped without transformers, trl or accelerate."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("accelerate")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from rank_processes import run_on_ranks  # noqa: E402
from test_hf import tiny  # noqa: E402
from test_hf_distributed import _batch, _grads  # noqa: E402

WORLD = 2


def _accelerate_fsdp2(model):
    """The student as accelerate's FSDP2 plugin prepares it (each decoder layer, the tail group, the root)."""
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[type(model.model.layers[0]).__name__],
                                            reshard_after_forward=True)
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                        mixed_precision="no", is_main_process=dist.get_rank() == 0,
                                        device=torch.device("cpu"))
    return fsdp2_prepare_model(accelerator, model)


def _trl_teacher_fsdp2(model):
    """The teacher as TRL's prepare_fsdp shards it: the root alone."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
    return model


def _gkd_losses_match(rank, world, family):
    from trl.experimental.gkd import GKDTrainer as TRLGKDTrainer

    from nitrobrew.trl import GKDTrainer

    vocab = 67
    input_ids, attention_mask, labels = _batch(rank, vocab)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    for s_layout, t_layout in (("fsdp2", "fsdp2"), ("ddp", "fsdp2"), ("fsdp2", "plain"), ("ddp", "plain")):
        student = tiny(family, hidden=32, vocab=vocab).double()
        teacher = tiny(family, hidden=48, vocab=vocab, seed=1).double().eval()
        student = _accelerate_fsdp2(student) if s_layout == "fsdp2" else torch.nn.parallel.DistributedDataParallel(student)
        teacher = _trl_teacher_fsdp2(teacher) if t_layout == "fsdp2" else teacher
        for beta in (0.1, 0.5):
            for items in (None, torch.tensor(19)):
                state = types.SimpleNamespace(teacher_model=teacher, beta=beta, nitrobrew_divergence="jsd",
                                              nitrobrew_alpha=0.1,
                                              accelerator=types.SimpleNamespace(unwrap_model=lambda m: m),
                                              generalized_jsd_loss=TRLGKDTrainer.generalized_jsd_loss)
                results = []
                for compute_loss in (TRLGKDTrainer.compute_loss, GKDTrainer.compute_loss):
                    for p in student.parameters():
                        p.grad = None
                    value = compute_loss(state, student, inputs, num_items_in_batch=items)
                    value.backward()
                    results.append((value.detach(), _grads(student)))
                (theirs, their_grads), (ours, our_grads) = results
                where = f"{family} {s_layout}/{t_layout} beta {beta} items {items} rank {rank}"
                torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12, msg=where)
                assert our_grads.keys() == their_grads.keys(), where
                for name, g in their_grads.items():
                    torch.testing.assert_close(our_grads[name], g, rtol=1e-7, atol=1e-10,
                                               msg=lambda m, name=name: f"{where} {name}: {m}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gkd_trainer_loss_equals_trl_s_on_sharded_and_ddp_students(family):
    run_on_ranks(WORLD, _gkd_losses_match, family)


def _distillation_losses_match(rank, world):
    import collections

    import torch.distributed as dist
    from accelerate.utils import extract_model_from_parallel
    from trl import DistillationTrainer as TRLDistillationTrainer
    from trl.trainer.distillation_trainer import _ForwardRedirection

    from nitrobrew.trl import DistillationTrainer

    def gather_for_metrics(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    vocab = 67
    input_ids, attention_mask, _ = _batch(rank, vocab)
    inputs = dict(prompt_ids=input_ids[:, :4], prompt_mask=attention_mask[:, :4], completion_ids=input_ids[:, 4:],
                  completion_mask=attention_mask[:, 4:])
    for s_layout, t_layout in (("fsdp2", "fsdp2"), ("ddp", "plain")):
        student = tiny("llama", hidden=32, vocab=vocab).double()
        teacher = tiny("llama", hidden=48, vocab=vocab, seed=1).double().eval()
        student = _accelerate_fsdp2(student) if s_layout == "fsdp2" else torch.nn.parallel.DistributedDataParallel(student)
        teacher = _trl_teacher_fsdp2(teacher) if t_layout == "fsdp2" else teacher
        results = []
        for trainer in (TRLDistillationTrainer, DistillationTrainer):
            accelerator = types.SimpleNamespace(unwrap_model=extract_model_from_parallel, num_processes=world,
                                                gather_for_metrics=gather_for_metrics, is_main_process=rank == 0)
            state = types.SimpleNamespace(model=student, teacher_model=teacher, beta=0.5, temperature=1.5,
                                          nitrobrew_divergence="jsd", nitrobrew_alpha=0.1, model_kwarg_keys=(), _is_vlm=False, accelerator=accelerator,
                                          _forward_redirection=_ForwardRedirection(),
                                          _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
            state._get_last_hidden_state = types.MethodType(TRLDistillationTrainer._get_last_hidden_state, state)
            state._compute_loss = types.MethodType(trainer._compute_loss, state)
            for p in student.parameters():
                p.grad = None
            value = TRLDistillationTrainer.compute_loss(state, student, inputs)
            value.backward()
            results.append((value.detach(), _grads(student)))
        (theirs, their_grads), (ours, our_grads) = results
        where = f"{s_layout}/{t_layout} rank {rank}: ours {ours.item():.12g}, TRL's {theirs.item():.12g}"
        # TRL's chunked divergence rounds through float32 (test_hf.py holds it to the same tolerances).
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=2e-4, atol=2e-6, msg=where)
        assert our_grads.keys() == their_grads.keys(), where
        for name, g in their_grads.items():
            torch.testing.assert_close(our_grads[name].double(), g.double(), rtol=2e-4, atol=2e-5,
                                       msg=lambda m, name=name: f"{where} {name}: {m}")


def test_distillation_trainer_loss_equals_trl_s_on_sharded_and_ddp_students():
    """nitrobrew.trl.DistillationTrainer (TRL's compute_loss, which runs _compute_loss inside the student's
    wrapper, with nitrobrew's divergence swapped in) against TRL's own on the same wrapped models."""
    run_on_ranks(WORLD, _distillation_losses_match)
