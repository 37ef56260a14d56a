"""Where nitrobrew.topk_logprobs spends its time on the GPU: CUDA time per kernel name (torch.profiler) -> CSV.

    python tools/profiling/topk_logprobs_kernel_times.py --out times.csv [--shape N,V,D ...] [--topk 8 256]
"""
import argparse
import collections
import csv

import torch
from torch.profiler import ProfilerActivity, profile

import nitrobrew

p = argparse.ArgumentParser()
p.add_argument("--shape", nargs="+", default=["32768,152064,5120", "8192,128256,4096"])
p.add_argument("--topk", type=int, nargs="+", default=[8, 256])
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--out", required=True)
args = p.parse_args()
rows = []
for shape in args.shape:
    n, v, d = (int(s) for s in shape.split(","))
    xt = torch.randn(n, d, device="cuda").bfloat16()
    wt = (torch.randn(v, d, device="cuda") * (3.0 / d**0.5)).bfloat16()
    for k in args.topk:
        nitrobrew.topk_logprobs(xt, wt, k)  # warm up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.repeats):
                nitrobrew.topk_logprobs(xt, wt, k)
            torch.cuda.synchronize()
        totals, counts = collections.Counter(), collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                totals[e.name[:90]] += e.device_time_total / args.repeats
                counts[e.name[:90]] += 1
        for name, us in totals.most_common(6):
            rows.append({"shape": shape, "K": k, "kernel": name, "ms_per_call": round(us / 1e3, 3),
                         "launches_per_call": counts[name] // args.repeats})
            print(f"{shape} K={k} {us / 1e3:8.3f} ms  x{counts[name] // args.repeats:4d}  {name}")
with open(args.out, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
