"""One step of a CUDA workload timed three ways, for the profiling tools: as a lone call (CUDA events
around it; the GPU waits while the host prepares the first launch, as in the benchmarks), behind a
queued sleep kernel (the host's lead hidden; the GPU rests during the sleep, though), and the host's
own time per call."""

import statistics
import time

import torch


def lone_and_queued(step, repeats, sleep_cycles, reset=lambda: None):
    """Runs step() `repeats` times alone, then `repeats` times behind torch.cuda._sleep(sleep_cycles)
    (choose it longer than the host's work); reset() runs before each, untimed. Returns the medians in
    ms: (lone, min lone, behind the sleep, host)."""
    lone, queued, host = [], [], []
    for behind_sleep in [False] * repeats + [True] * repeats:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if behind_sleep:
            torch.cuda._sleep(sleep_cycles)
        reset()
        start.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        (queued if behind_sleep else lone).append(start.elapsed_time(end))
    return statistics.median(lone), min(lone), statistics.median(queued), statistics.median(host)
