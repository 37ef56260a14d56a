"""Benchmark nitrobrew.topk_logprobs (a teacher's top-K log-probabilities from its hidden states) -> CSV.

    python benchmarks/topk_logprobs.py                 # CUDA: N 8192 and 32768, Qwen and Llama-3 teachers, bf16
    python benchmarks/topk_logprobs.py --device cpu --shape 512,32000,1024 --topk 8 32

The teacher's hidden states xt [N, D] and unembedding wt [V, D] exist before the timed region. Methods, in
one run, every (method, K) measured once per round over --rounds rounds:
  gemm              cuBLAS's one product xt @ wt.T in the inputs' dtype: the floor the target is a ratio to;
  nitrobrew         nitrobrew.topk_logprobs (for 16-bit inputs, K <= 32 and V >= 8192 its walk path, else its row path);
  nitrobrew_rows    nitrobrew.topk_logprobs's row path, forced by a development build's NITROBREW_TOPK_LOGPROBS_WALK=off
                    (needs NITROBREW_DEV_KNOBS=1, as tools/gpu/check.sh builds and runs): token chunks of cuBLAS float32
                    logits, each read once by a row kernel;
  naive_bf16        the logits in the inputs' dtype, log_softmax in float32, torch.topk;
  naive_float32     the logits from float32 inputs (the accurate one), log_softmax, torch.topk;
  chunked_naive     naive_bf16 over token chunks of 2048: the simplest bounded-memory composition;
  composition       token chunks of cuBLAS float32 logits (nitrobrew's products op), ATen's top-K on order keys,
                    logsumexp and entropy (nitrobrew/_topk_logprobs_chunked.py): the same outputs from pieces.
Columns: the median of the rounds' medians of --repeats runs, the fastest, the peak memory above the inputs
(MiB), the ratio to the gemm row, and the rounds' medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from pathlib import Path

import torch

import nitrobrew
from harness import OOM_ERROR, device_name, free_device_memory, measure_rounds, memory_baseline, peak_extra_mib
from harness import short_error, time_runs, write_csv

COLUMNS = ["date", "device", "torch", "cuda", "method", "K", "dtype", "N", "V", "D", "status", "median_ms", "min_ms",
           "peak_extra_mib", "ratio_to_gemm", "rounds", "round_medians_ms"]
SHAPES = ["8192,152064,5120", "8192,128256,4096", "32768,152064,5120", "32768,128256,4096"]


def naive(xt, wt, k):
    return (xt @ wt.T).float().log_softmax(-1).topk(k, dim=-1)


def chunked_naive(xt, wt, k, chunk=2048):
    parts = [naive(xt[r:r + chunk], wt, k) for r in range(0, xt.shape[0], chunk)]
    return torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])


def method_run(method, xt, wt, k):
    if method == "gemm":
        return lambda: xt @ wt.T
    if method == "nitrobrew":
        return lambda: nitrobrew.topk_logprobs(xt, wt, k)
    if method == "nitrobrew_rows":
        if os.environ.get("NITROBREW_DEV_KNOBS") != "1":  # a shipped build would time its default path instead
            raise RuntimeError("nitrobrew_rows needs a development build run with NITROBREW_DEV_KNOBS=1")

        def rows_path():
            os.environ["NITROBREW_TOPK_LOGPROBS_WALK"] = "off"
            try:
                return nitrobrew.topk_logprobs(xt, wt, k)
            finally:
                del os.environ["NITROBREW_TOPK_LOGPROBS_WALK"]

        return rows_path
    if method == "naive_bf16":
        return lambda: naive(xt, wt, k)
    if method == "naive_float32":
        xt32, wt32 = xt.float(), wt.float()  # made before the timed region, as a float32 teacher holds them
        return lambda: naive(xt32, wt32, k)
    if method == "chunked_naive":
        return lambda: chunked_naive(xt, wt, k)
    if method == "composition":
        from nitrobrew._topk_logprobs_chunked import topk_logprobs_chunked

        return lambda: topk_logprobs_chunked(xt, wt, k, None, 1.0, None, 1.0, wt.shape[0])
    raise ValueError(method)


METHODS = ["gemm", "nitrobrew", "nitrobrew_rows", "naive_bf16", "naive_float32", "chunked_naive", "composition"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    has_cuda = torch.cuda.is_available()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if has_cuda else "cpu")
    p.add_argument("--shape", nargs="+", default=SHAPES, help="N,V,D")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--topk", type=int, nargs="+", default=[8, 32, 128, 256])
    default_methods = [m for m in METHODS if m != "nitrobrew_rows" or os.environ.get("NITROBREW_DEV_KNOBS") == "1"]
    p.add_argument("--methods", nargs="+", choices=METHODS, default=default_methods)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.repeats < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--repeats and --rounds must be at least 1, --warmup at least 0")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    today = datetime.date.today().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"topk_logprobs_{args.device}_{today}.csv"
    rows = []
    for shape in args.shape:
        n, v, d = (int(x) for x in shape.split(","))
        torch.manual_seed(0)
        xt = torch.randn(n, d, device=device).to(dtype)
        wt = (torch.randn(v, d, device=device) * (3.0 / d**0.5)).to(dtype)
        common = {"date": today, "device": device_name(device), "torch": torch.__version__,
                  "cuda": torch.version.cuda or "", "dtype": args.dtype, "N": n, "V": v, "D": d}
        specs = [{"method": "gemm", "K": ""}] if "gemm" in args.methods else []
        specs += [{"method": m, "K": k} for k in args.topk for m in args.methods if m != "gemm"]
        for spec in specs:
            spec["label"] = f"{spec['method']} K={spec['K']} {shape}"

        def measure_one(spec):
            try:
                run = method_run(spec["method"], xt, wt, spec["K"])
                base = memory_baseline(device)
                with torch.no_grad():
                    times = time_runs(run, device, args.warmup, args.repeats)
                return {"status": "ok", "median_ms": statistics.median(times), "min_ms": min(times),
                        "peak_extra_mib": peak_extra_mib(device, base)}
            except OOM_ERROR as e:
                return {"status": "oom", "error": short_error(e)}
            finally:
                free_device_memory(device)

        results = measure_rounds(specs, measure_one, args.rounds)
        floor = next((r["median_ms"] for s, r in zip(specs, results) if s["method"] == "gemm"), None)
        for spec, result in zip(specs, results):
            row = {**common, "method": spec["method"], "K": spec["K"], "rounds": args.rounds, **result}
            if row["status"] == "ok" and floor:
                row["ratio_to_gemm"] = row["median_ms"] / floor
            rows.append(row)
            print(f"{shape:20s} {row['method']:14s} K={row['K']!s:<4s} {row['status']:4s} "
                  f"{row.get('median_ms', float('nan')):8.2f} ms {row.get('ratio_to_gemm', float('nan')):6.2f}x "
                  f"{row.get('peak_extra_mib', float('nan')):9.1f} MiB")
        del xt, wt
        free_device_memory(device)
        write_csv(out, COLUMNS, rows)  # after every shape: a run cut short keeps the shapes it finished


if __name__ == "__main__":
    main()
