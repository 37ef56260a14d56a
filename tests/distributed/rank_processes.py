"""Runs a function on `world` processes joined in a torch.distributed group, as the multi-process tests need."""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, backend: str, fn, args) -> None:
    # A rank still running after NITROBREW_RANK_WATCHDOG_S seconds prints every thread's stack and exits,
    # so a hang (a kernel or a collective) shows where each rank stands instead of stalling the run.
    watchdog = float(os.environ.get("NITROBREW_RANK_WATCHDOG_S", "1200"))
    faulthandler.dump_traceback_later(watchdog, exit=True)
    if backend == "nccl":  # one GPU per rank
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # A collective that waits past the timeout raises (NCCL aborts the rank) rather than hanging the test run.
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=180))
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears its connections down while another still reads from them
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    exit_now()


def exit_now() -> None:
    """Ends a rank that finished its work without the interpreter's finalization. Now and then a rank
    that had passed every check and destroyed its group died there of SIGABRT ("terminate called without
    an active exception": a C++ thread of torch's gloo backend destroyed while still joinable), which
    failed a passing test."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def ranks_on_the_gpu(monkeypatch) -> None:
    """The spawned ranks put their tensors on CUDA (vocab_parallel_cases._device), with NVLink multicast
    off, as it stays on shared hosts (the device library's KINDS.md)."""
    monkeypatch.setenv("NITROBREW_TEST_DEVICE", "cuda")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        monkeypatch.setenv(name, value)


def run_on_ranks(world: int, fn, *args, backend: str = "gloo") -> None:
    """fn(rank, world, *args) on each of `world` spawned processes (over NCCL: rank r on GPU r); a failure
    on any rank raises here with that rank's traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_worker, args=(world, init_file, backend, fn, args), nprocs=world, join=True)
