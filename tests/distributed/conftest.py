"""Fixtures of the distributed tests."""

import pytest


@pytest.fixture
def ranks_on_the_gpu(monkeypatch):
    """The spawned ranks put their tensors on CUDA (vocab_parallel_cases._device), with NVLink multicast
    off, as it stays on shared hosts (the device library's KINDS.md)."""
    monkeypatch.setenv("NITROBREW_TEST_DEVICE", "cuda")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        monkeypatch.setenv(name, value)
