"""Where a fused-linear training step's GPU time goes: CUDA kernel time per kernel name (summed over one
step, after warm-up), from torch.profiler, for nitrobrew's paths and the baselines of fused_linear.py.

    python tools/profiling/kernel_times.py --shape 8192,152064,3584,5120 --methods nitrobrew composition
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fused_linear as bench  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trace_gaps  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8192,152064,3584,5120")
    p.add_argument("--methods", nargs="+", default=["nitrobrew"])
    p.add_argument("--loss", default="forward_kl")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--gaps", action="store_true", help="also the GPU's idle gaps in the step (trace_gaps)")
    args = p.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    xs, xt, ws, wt = bench.make_inputs(shape, torch.bfloat16, torch.device("cuda"), requires_grad=True)
    for name in args.methods:
        fn = bench.METHODS[name]

        def step():
            out = fn(xs, xt, ws, wt, loss=args.loss, reduction="mean")
            torch.autograd.grad(out, (xs, ws))

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if args.gaps else [])
        with torch.profiler.profile(activities=activities) as prof:
            step()
            torch.cuda.synchronize()
        totals, counts = collections.defaultdict(float), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                counts[e.name] += 1
        total = sum(totals.values())
        print(f"\n{name} {shape}: {total / 1e3:.1f} ms of kernels")
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {v / 1e3:8.2f} ms {counts[k]:5d}x  {k[:110]}")
        if args.gaps:
            trace_gaps.print_gaps(prof, top=10)


if __name__ == "__main__":
    main()
