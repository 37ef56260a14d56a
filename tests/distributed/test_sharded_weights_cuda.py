"""DTensor lm_head weights over NCCL, one rank a GPU, where the machine has 2 to 4 GPUs: tensor
parallelism's layout and FSDP2's on a tiny Hugging Face model, float32 (the CUDA kernels take no
float64), against the single-GPU loss and the model's own logits (sharded_weight_cases.py)."""

import pytest
import torch
import torch.distributed as dist

from rank_processes import ranks_on_the_gpu, run_on_ranks

WORLDS = [w for w in (2, 3, 4) if torch.cuda.is_available() and torch.cuda.device_count() >= w]

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(), reason="no NCCL"),
    pytest.mark.skipif(not WORLDS, reason="needs 2 or more GPUs"),
    pytest.mark.usefixtures("_on_the_gpu"),
]


@pytest.fixture
def _on_the_gpu(monkeypatch):
    ranks_on_the_gpu(monkeypatch)


@pytest.mark.parametrize("world", WORLDS or [2])
def test_tensor_parallel_nccl(world):
    import sharded_weight_cases as cases

    run_on_ranks(world, cases.tensor_parallel, backend="nccl")


@pytest.mark.parametrize("world", WORLDS or [2])
def test_data_parallel_nccl(world):
    import sharded_weight_cases as cases

    run_on_ranks(world, cases.data_parallel, backend="nccl")


@pytest.mark.parametrize("world", WORLDS or [2])
def test_data_parallel_topk_nccl(world):
    import sharded_weight_cases as cases

    run_on_ranks(world, cases.data_parallel_topk, backend="nccl")


@pytest.mark.parametrize("world", WORLDS or [2])
def test_fsdp2_tiny_llama_nccl(world):
    pytest.importorskip("transformers")
    import sharded_weight_cases as cases

    run_on_ranks(world, cases.fsdp2_tiny_llama, backend="nccl")


def test_fsdp2_a_bad_batch_on_one_rank_raises_on_every_rank_nccl():
    import sharded_weight_cases as cases

    run_on_ranks(2, cases.fsdp2_bad_batch_is_skipped, backend="nccl")
