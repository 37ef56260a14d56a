"""lm_head weights given as DTensors sharded on dim 0 (2 CPU processes over gloo): tensor parallelism's
layout (xs replicated) and FSDP2's on a tiny Hugging Face model (each rank's own tokens), against the
single-process loss and the model's own logits; unsupported layouts raise (sharded_weight_cases.py)."""

import pytest
import torch.distributed as dist

from rank_processes import run_on_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel(world):
    import sharded_weight_cases as cases

    run_on_ranks(world, cases.tensor_parallel)


def test_unsupported_layouts_raise():
    import sharded_weight_cases as cases

    run_on_ranks(2, cases.layouts)


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel(world):
    import sharded_weight_cases as cases

    run_on_ranks(world, cases.data_parallel)


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_topk(world):
    import sharded_weight_cases as cases

    run_on_ranks(world, cases.data_parallel_topk)


def test_fsdp2_tiny_llama():
    pytest.importorskip("transformers")
    import sharded_weight_cases as cases

    run_on_ranks(2, cases.fsdp2_tiny_llama)


def test_hf_refuses_tensor_parallel_lm_heads_with_a_clear_error():
    pytest.importorskip("transformers")
    import sharded_weight_cases as cases

    run_on_ranks(2, cases.hf_refuses_tensor_parallel_lm_heads)


def test_fsdp2_a_bad_batch_on_one_rank_raises_on_every_rank():
    import sharded_weight_cases as cases

    run_on_ranks(2, cases.fsdp2_bad_batch_is_skipped)


def test_fsdp2_a_bad_teacher_mass_on_one_rank_raises_on_every_rank():
    import sharded_weight_cases as cases

    run_on_ranks(2, cases.fsdp2_bad_teacher_mass_is_skipped)


def test_process_group_with_dtensor_weights_is_refused():
    import sharded_weight_cases as cases

    run_on_ranks(2, cases.process_group_and_dtensors_refused)
