"""Sums an `ncu --csv --page raw` run of backward_budget.sh per kernel kind, over the last step the
run profiled (from the last launch of the forward's vocabulary pass on): launches, GPU time and
cycles at ncu's fixed clock, how busy the SMs were (where the run measured sm__cycles_active), DRAM
bytes, and the rate of the matrix products in TFLOP/s where the kind's FLOPs are known. With --out,
appends the rows to a CSV (with the device, shape and source columns).

    python3 tools/profiling/ncu_step_summary.py ncu_qwen.csv --shape 8192,152064,3584,5120
"""

import argparse
import csv
import datetime
from pathlib import Path


def kind(name):
    if "StudentGradPass" in name:
        return "top-K gradient pass (nitrobrew)"
    if "StudentNormPass" in name:
        return "top-K forward pass (nitrobrew)"
    if "GradPass" in name:
        return "gradient pass (nitrobrew)"
    if "KLPass" in name:
        return "KL pass (nitrobrew)"
    if "CUDAFunctor_add" in name:
        return "gradient accumulation into .grad (a run that did not reset gradients between its steps)"
    if "nvjet" in name or "gemm" in name.lower():
        # The backward's products by cuBLAS: dxs += dz . ws_chunk (beta = 1: "badd"), dws_chunk = dz^T . (g xs).
        return "cuBLAS dxs" if "badd" in name else "cuBLAS dws"
    return "other (elementwise, fills, merge)"


def flops(k, n, v, d_s, d_t):
    """FLOPs of a kind's products in one step, or None."""
    return {"gradient pass (nitrobrew)": 2 * n * v * (d_s + d_t), "KL pass (nitrobrew)": 2 * n * v * (d_s + d_t),
            "top-K forward pass (nitrobrew)": 2 * n * v * d_s, "top-K gradient pass (nitrobrew)": 2 * n * v * d_s,
            "cuBLAS dxs": 2 * n * v * d_s, "cuBLAS dws": 2 * n * v * d_s}.get(k)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("csv")
    p.add_argument("--shape", required=True, help="N,V,Ds,Dt of the profiled step")
    p.add_argument("--device", default="")
    p.add_argument("--out", type=Path, help="CSV to append the summary to")
    args = p.parse_args()
    n, v, d_s, d_t = (int(x) for x in args.shape.split(","))
    rows = list(csv.reader(open(args.csv)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    head, data = rows[start], [r for r in rows[start + 2:] if len(r) > 4]  # a units row follows the header
    col = {c: head.index(c) for c in head}
    # A step starts with its forward's vocabulary pass (the KL pass, or the top-K loss's norm pass).
    first = "KLPass" if any("KLPass" in r[col["Kernel Name"]] for r in data) else "StudentNormPass"
    data = data[max(i for i, r in enumerate(data) if first in r[col["Kernel Name"]]):]

    def num(r, c):
        return float(r[col[c]].replace(",", "")) if c in col and r[col[c]] else 0.0

    kinds = {}
    for r in data:
        k = kinds.setdefault(kind(r[col["Kernel Name"]]), dict(n=0, ns=0.0, cyc=0.0, active=0.0, rd=0.0, wr=0.0))
        k["n"] += 1
        k["ns"] += num(r, "gpu__time_duration.sum")
        k["cyc"] += num(r, "sm__cycles_elapsed.max")
        k["active"] += num(r, "sm__cycles_active.avg")  # absent from older runs: 0
        k["rd"] += num(r, "dram__bytes_read.sum")
        k["wr"] += num(r, "dram__bytes_write.sum")
    out = []
    for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["ns"]):
        f = flops(name, n, v, d_s, d_t)
        out.append(dict(kernel=name, launches=k["n"], ms=round(k["ns"] / 1e6, 3), mcycles=round(k["cyc"] / 1e6, 2),
                        ghz=round(k["cyc"] / k["ns"], 3) if k["ns"] else "",
                        tflops=round(f / (k["ns"] * 1e-9) / 1e12, 1) if f and k["ns"] else "",
                        sm_busy_pct=round(100 * k["active"] / k["cyc"], 1) if k["active"] and k["cyc"] else "",
                        dram_read_gb=round(k["rd"] / 1e9, 2), dram_write_gb=round(k["wr"] / 1e9, 2)))
    print(f"{'kernel':80s} {'n':>3s} {'ms':>8s} {'Mcycles':>8s} {'GHz':>6s} {'TFLOP/s':>8s} {'SM busy %':>9s} "
          f"{'DRAM rd GB':>10s} {'wr GB':>6s}")
    for o in out:
        print(f"{o['kernel']:80s} {o['launches']:3d} {o['ms']:8.3f} {o['mcycles']:8.2f} {o['ghz']:>6} {o['tflops']:>8} "
              f"{o['sm_busy_pct']:>9} {o['dram_read_gb']:10.2f} {o['dram_write_gb']:6.2f}")
    if args.out:
        new = not args.out.exists()
        with open(args.out, "a", newline="") as f:
            w = csv.DictWriter(f, ["date", "device", "source", "N", "V", "Ds", "Dt", *out[0].keys()])
            if new:
                w.writeheader()
            for o in out:
                w.writerow(dict(date=datetime.date.today().isoformat(), device=args.device,
                                source="ncu --clock-control base: every kernel of the last profiled forward + backward",
                                N=n, V=v, Ds=d_s, Dt=d_t, **o))


if __name__ == "__main__":
    main()
