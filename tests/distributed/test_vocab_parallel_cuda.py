"""The vocabulary-parallel losses on CUDA: world size 1 over NCCL and 2 to 4 processes sharing one GPU
over gloo (every world size's shards through the CUDA kernels), and where there are several GPUs NCCL
over 2 to 4 of them, one rank a GPU (uneven shards; vocab_size inside a shard and a shard wholly in the
padding), 16-bit and float32, against the single-GPU loss and, for 16-bit, the float64 reference under
the CUDA tests' tolerance rule (vocab_parallel_cases.py)."""

import pytest
import torch
import torch.distributed as dist

import vocab_parallel_cases as cases
from rank_processes import ranks_on_the_gpu, run_on_ranks

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.usefixtures("_on_the_gpu"),
]


@pytest.fixture
def _on_the_gpu(monkeypatch):
    ranks_on_the_gpu(monkeypatch)

# One GPU: NCCL over 1 rank, and 2 to 4 ranks sharing it over gloo; several GPUs: NCCL, one rank a GPU.
RUNS = [pytest.param(1, "nccl", id="nccl-1")] + [
    pytest.param(world, "gloo", id=f"gloo-{world}-on-one-gpu") for world in (2, 3, 4)] + [
    pytest.param(world, "nccl", id=f"nccl-{world}") for world in (2, 3, 4)
    if torch.cuda.is_available() and torch.cuda.device_count() >= world]


@pytest.mark.parametrize("world,backend", RUNS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_linear(world, backend, dtype):
    run_on_ranks(world, cases.fused_linear, dtype, backend=backend)


@pytest.mark.parametrize("world,backend", RUNS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_linear_training_path(world, backend, dtype):
    # grad_in_forward=True over the shards: product_partials / product_grads on the GPU.
    run_on_ranks(world, cases.fused_linear, dtype, True, backend=backend)


@pytest.mark.parametrize("world,backend", RUNS)
def test_logits(world, backend):
    run_on_ranks(world, cases.logits, "bfloat16", backend=backend)


@pytest.mark.parametrize("world,backend", RUNS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_topk_linear(world, backend, dtype):
    run_on_ranks(world, cases.topk_linear, dtype, backend=backend)


@pytest.mark.parametrize("world,backend", RUNS)
def test_topk_linear_training_path(world, backend):
    # grad_in_forward=True, normalize="full": products, the top-K passes and the shards' merge on the GPU.
    run_on_ranks(world, cases.topk_linear, "float32", True, backend=backend)


@pytest.mark.parametrize("world,backend", RUNS)
def test_topk_logits(world, backend):
    run_on_ranks(world, cases.topk_logits, "bfloat16", backend=backend)


@pytest.mark.parametrize("world,backend", RUNS)
def test_float64_is_refused_on_every_rank(world, backend):
    run_on_ranks(world, cases.float64_on_cuda, backend=backend)
