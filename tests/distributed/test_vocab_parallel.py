"""Vocabulary-parallel losses (process_group=) on 1 to 4 CPU processes over gloo, uneven shards:
every loss and option against the single-process loss of the whole vocabulary and the float64
reference, values and gradients (cases.py)."""

import pytest
import torch.distributed as dist

import vocab_parallel_cases as cases
from rank_processes import run_on_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fused_linear(world):
    run_on_ranks(world, cases.fused_linear, "float64")


@pytest.mark.parametrize("world", [2, 3])
def test_fused_linear_float32(world):
    run_on_ranks(world, cases.fused_linear, "float32")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fused_linear_training_path(world):
    # grad_in_forward=True: the gradients formed in the forward, the shards' rows merged per step.
    run_on_ranks(world, cases.fused_linear, "float64", True)


@pytest.mark.parametrize("world", [2, 3])
def test_fused_linear_training_path_float32(world):
    run_on_ranks(world, cases.fused_linear, "float32", True)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_logits(world):
    run_on_ranks(world, cases.logits, "float64")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_topk_linear(world):
    run_on_ranks(world, cases.topk_linear, "float64")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_topk_linear_training_path(world):
    # grad_in_forward=True, normalize="full": the shards' top-K row states merged per step of the chunk loop.
    run_on_ranks(world, cases.topk_linear, "float64", True)


@pytest.mark.parametrize("world", [3])
def test_topk_linear_float32(world):
    run_on_ranks(world, cases.topk_linear, "float32")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_topk_logits(world):
    run_on_ranks(world, cases.topk_logits, "float64")


def test_bad_input_raises_on_every_rank():
    run_on_ranks(2, cases.errors)


def test_a_process_group_needs_torch_distributed_initialized():
    xs, xt, ws, wt, *_ = cases._inputs(cases.torch.float64)
    with pytest.raises(RuntimeError, match="init_process_group"):
        cases.nitrobrew.forward_kl(xs, xt, ws, wt, process_group=object())


def test_the_module_takes_a_process_group():
    run_on_ranks(3, cases.module)


def test_under_torch_compile():
    run_on_ranks(2, cases.compiled)


def test_a_rank_whose_shard_is_empty():
    run_on_ranks(2, cases.empty_shard)
