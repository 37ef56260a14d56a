"""What the benchmark CLIs share: timing, peak-memory measurement, per-measurement worker processes.

Imported as `harness` by the scripts beside it (run as `python benchmarks/<name>.py`, which puts this
folder on sys.path).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

OOM_ERROR = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _vm_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def memory_baseline(device):
    """Resets the peak-memory mark; returns what is held now (bytes), for peak_extra_mib."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    try:  # "5" resets the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # then the baseline is the peak so far: creating the inputs, which is at least the inputs
    return _vm_kib("VmHWM") * 1024


def peak_extra_mib(device, baseline):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - baseline) / 2**20
    return (_vm_kib("VmHWM") * 1024 - baseline) / 2**20


def time_runs(run, device, warmup, repeats, min_seconds=0.0):
    """Times of `repeats` runs after `warmup` untimed ones, in ms; with min_seconds > 0, at least as
    many runs as fill that long, up to 1000 (for millisecond calls, whose median over 5 runs can catch a
    slow spell)."""
    for _ in range(warmup):
        run()
    times = []
    if min_seconds > 0:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        repeats = max(repeats, min(1000, math.ceil(min_seconds / max(time.perf_counter() - t0, 1e-6))))
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_rounds(specs, measure_one, rounds):
    """Measures every spec `rounds` times, all specs once per round in the given order, so that a slow
    spell (a power-capped GPU's clock drifts over minutes) falls on every method alike; returns one
    result per spec: the median of the rounds' medians, the fastest run, the largest peak memory and
    the rounds' medians. A spec that fails in a round is not measured again; its failure is its result."""
    results = [[] for _ in specs]
    for r in range(rounds):
        for i, spec in enumerate(specs):
            if results[i] and results[i][-1].get("status") != "ok":
                continue
            label = f" (round {r + 1}/{rounds})" if rounds > 1 else ""
            print(f"[{i + 1}/{len(specs)}]{label} {spec['label']}", flush=True)
            results[i].append(measure_one(spec))
    merged = []
    for runs in results:
        if runs[-1].get("status") != "ok":
            merged.append(runs[-1])
            continue
        merged.append({**runs[-1], "median_ms": statistics.median(x["median_ms"] for x in runs),
                       "min_ms": min(x["min_ms"] for x in runs),
                       "peak_extra_mib": max(x["peak_extra_mib"] for x in runs),
                       "round_medians_ms": " ".join(f"{x['median_ms']:.3f}" for x in runs)})
    return merged


def short_error(e):
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def measure_in_subprocess(script, spec):
    """Runs `script --worker <spec>` (which prints its result as JSON) in a fresh process, so that the
    peak RSS belongs to this measurement alone."""
    cmd = [sys.executable, script, "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr passes through: tracebacks show
    if proc.returncode in (-9, 137):  # SIGKILL: almost always the kernel's OOM killer
        return {"status": "oom", "error": "worker killed (SIGKILL)"}
    if proc.returncode != 0:
        return {"status": "error", "error": f"worker exited with status {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def free_device_memory(device):
    # After an oom the failed run's tensors are gone with measure()'s frame; hand the cached blocks back too,
    # so that the next row starts from the same place.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return models[0] if models else platform.processor() or "cpu"


def fmt(value, spec=".1f"):
    return "" if value is None or value == "" else format(value, spec)


def pyplot():
    """matplotlib.pyplot with the file-only backend, or None (saying so) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): skipping the plot")
        return None
    return plt


def grouped_bars(ax, groups, series, *, fontsize=None):
    """Bars of series {label: [value per group]} side by side in each of `groups` (tick labels), log scale."""
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(groups))], values, width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups, fontsize=fontsize)
    ax.set_yscale("log")


def save_figure(fig, out):
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')}")


def write_csv(out, columns, rows):
    """rows (dicts) as CSV at out, floats to 4 significant digits, keys outside columns dropped."""
    import csv

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: (f"{val:.4g}" if isinstance(val, float) else val) for key, val in row.items()})
    print(f"wrote {out}")


def _rank_then_exit(rank, worker, world, init_file, args, queue):
    """worker(rank, world, init_file, args), which joins a process group and returns its results; rank
    0's go on the queue. Then the group's end, and the process's without the interpreter's
    finalization, where torch's gloo backend now and then aborts a rank that finished its work (a C++
    thread destroyed while joinable). The queue's data is flushed first."""
    import torch.distributed as dist

    results = worker(rank, world, init_file, args)
    if rank == 0:
        queue.put(results)
    dist.barrier()  # no rank tears its connections down while another still reads from them
    dist.destroy_process_group()
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def results_of_ranks(worker, world, args):
    """worker(rank, world, init_file, args) on `world` spawned processes (a file rendezvous at
    init_file); returns what rank 0's returns. A rank that fails raises here, instead of leaving
    the queue empty for good."""
    import tempfile
    from queue import Empty

    import torch.multiprocessing as mp

    queue = mp.get_context("spawn").Queue()
    with tempfile.TemporaryDirectory() as tmp:
        processes = mp.start_processes(_rank_then_exit, nprocs=world, join=False, start_method="spawn",
                                       args=(worker, world, os.path.join(tmp, "rendezvous"), args, queue))
        while True:
            try:
                results = queue.get(timeout=5)
                break
            except Empty:
                processes.join(timeout=0)
        processes.join()
    return results
