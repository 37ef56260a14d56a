"""Benchmark nitrobrew.topk_kl (top-K teacher distillation from hidden states) -> CSV and plot.

    python benchmarks/topk_linear.py                        # CUDA: N = 8192, V = 152064, D = 3584, bf16
    python benchmarks/topk_linear.py --device cpu --shape 256,32000,512 --topk 32 --dtype float32

The student's hidden states xs [N, D] and unembedding ws [V, D] and the teacher's top-K ids and
log-probabilities exist before the timed region. Each run computes the loss (mode "forward", under
no_grad) or the loss and its gradients for xs and ws ("fwd_bwd"). Methods, in one run:
  nitrobrew   nitrobrew.topk_kl, normalize="full" and "topk";
  naive       PyTorch: the logits xs @ ws.T (inputs' dtype), float32 log_softmax, gather, the K terms;
  gemm        the cuBLAS products the loss needs, alone: xs @ ws.T (forward), then dLoss/dz @ ws and
              dLoss/dz^T @ xs (fwd_bwd): the compute floor the target is a ratio to.
Every (method, normalize, K, mode) is measured once per round, --rounds rounds one after another, so that
a slow spell of a power-capped GPU falls on the gemm floor and the methods alike. Columns: the median of
the rounds' medians of --repeats runs after --warmup, the fastest run, peak memory above the inputs
(MiB), the ratio of the median to the gemm row's median of the same mode and the rounds' medians.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import nitrobrew
from harness import OOM_ERROR, device_name, free_device_memory, grouped_bars, measure_rounds, memory_baseline
from harness import peak_extra_mib, pyplot, save_figure, short_error, time_runs, write_csv

COLUMNS = ["date", "device", "torch", "cuda", "method", "normalize", "K", "mode", "dtype", "N", "V", "D", "status",
           "median_ms", "min_ms", "peak_extra_mib", "ratio_to_gemm", "rounds", "round_medians_ms"]


def teacher_topk(xs, ws, k, block=1024):
    """A teacher's top-K ids and float32 log-probabilities: those of the student's logits plus unit
    noise, computed `block` rows at a time (never the whole [N, V])."""
    n = xs.shape[0]
    ids = torch.empty(n, k, dtype=torch.int64, device=xs.device)
    lps = torch.empty(n, k, dtype=torch.float32, device=xs.device)
    with torch.no_grad():
        for r in range(0, n, block):
            z = (xs[r:r + block] @ ws.T).float()
            z += torch.randn_like(z)
            lps[r:r + block], ids[r:r + block] = torch.log_softmax(z, -1).topk(k, dim=-1)
    return ids, lps


def naive_topk(xs, ws, ids, lps, normalize):
    s = (xs @ ws.T).float()
    if normalize == "full":
        log_p, log_q = F.log_softmax(s, -1).gather(-1, ids), lps
    else:
        log_p, log_q = F.log_softmax(s.gather(-1, ids), -1), F.log_softmax(lps, -1)
    return (log_q.exp() * (log_q - log_p)).sum(-1).mean()


def gemm_run(xs, ws, mode):
    """The products alone, with a dLoss/dz of the logits' shape standing in for the loss's."""
    grad = torch.empty(xs.shape[0], ws.shape[0], dtype=xs.dtype, device=xs.device).normal_()

    def run():
        z = xs @ ws.T
        if mode == "fwd_bwd":
            grad @ ws
            grad.T @ xs
        return z

    return run


class _Composition(torch.autograd.Function):
    """What a user composes from nitrobrew's logits kernels (issue 42's baseline, top-K's analogue): token
    chunks of 2048, the chunk's student logits from cuBLAS in the inputs' dtype, dLoss/dz from
    nitrobrew.logits.topk_kl and autograd in the forward, dxs = dz . ws and dws += dz^T . xs; the backward
    only scales the saved gradients."""

    chunk = 2048

    @staticmethod
    def forward(ctx, xs, ws, ids, lps, normalize):
        dxs, dws = torch.empty_like(xs), torch.zeros_like(ws)
        total = torch.zeros((), device=xs.device)
        for c0 in range(0, xs.shape[0], _Composition.chunk):
            c1 = c0 + _Composition.chunk
            x = xs[c0:c1]
            zs = (x @ ws.T).requires_grad_()
            with torch.enable_grad():
                chunk_loss = nitrobrew.logits.topk_kl(zs, ids[c0:c1], lps[c0:c1], normalize=normalize, reduction="sum")
                (dz,) = torch.autograd.grad(chunk_loss, zs)
            del zs
            dxs[c0:c1] = dz @ ws
            dws.addmm_(dz.T, x)
            total += chunk_loss.detach()
        ctx.save_for_backward(dxs, dws)
        ctx.n = max(xs.shape[0], 1)
        return total / ctx.n

    @staticmethod
    def backward(ctx, grad):
        dxs, dws = ctx.saved_tensors
        scale = grad / ctx.n
        return dxs * scale, dws * scale, None, None, None


# The methods timed against the products: nitrobrew (automatic path), its training path (normalize="full";
# grad_in_forward=True), its recompute path (False), the composition above, naive PyTorch.
METHODS = {
    "nitrobrew": lambda xs, ws, ids, lps, normalize: nitrobrew.topk_kl(xs, ws, ids, lps, normalize=normalize),
    "nitrobrew_training": lambda xs, ws, ids, lps, normalize: nitrobrew.topk_kl(
        xs, ws, ids, lps, normalize=normalize, grad_in_forward=torch.is_grad_enabled() or None),
    "nitrobrew_recompute": lambda xs, ws, ids, lps, normalize: nitrobrew.topk_kl(
        xs, ws, ids, lps, normalize=normalize, grad_in_forward=False),
    "composition": lambda xs, ws, ids, lps, normalize: _Composition.apply(xs, ws, ids, lps, normalize),
    "naive": lambda xs, ws, ids, lps, normalize: naive_topk(xs, ws, ids, lps, normalize),
}


def _training_only(method):
    """Methods that are a training step (fwd_bwd), the training path for normalize="full" alone."""
    return method in ("nitrobrew_training", "composition")


def measure(method, normalize, mode, xs, ws, ids, lps, args):
    device = xs.device
    if method == "gemm":
        run = gemm_run(xs.detach(), ws.detach(), mode)
    else:
        def fn(*a):
            return METHODS[method](*a, normalize)

        def run():
            if mode == "forward":
                with torch.no_grad():
                    return fn(xs, ws, ids, lps)
            xs.grad = ws.grad = None
            fn(xs, ws, ids, lps).backward()

    xs.grad = ws.grad = None
    base = memory_baseline(device)
    times = time_runs(run, device, args.warmup, args.repeats)
    result = {"status": "ok", "median_ms": statistics.median(times), "min_ms": min(times),
              "peak_extra_mib": peak_extra_mib(device, base)}
    xs.grad = ws.grad = None
    return result


def plot(rows, out):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, ("forward", "fwd_bwd")):
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok" and r["method"] != "gemm"]
        ks = sorted({r["K"] for r in ok})
        series = {f"{method} {normalize}": [next((r["ratio_to_gemm"] for r in ok if r["K"] == k and r["method"] == method
                                                  and r["normalize"] == normalize), 0) for k in ks]
                  for method, normalize in sorted({(r["method"], r["normalize"]) for r in ok})}
        grouped_bars(ax, [f"K={k}" for k in ks], series)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{mode}: time / cuBLAS products")
    axes[0].legend(fontsize=8)
    save_figure(fig, out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    has_cuda = torch.cuda.is_available()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if has_cuda else "cpu")
    p.add_argument("--shape", default="8192,152064,3584", help="N,V,D")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--topk", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=["nitrobrew", "naive"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="measure every method this many times, one round after another")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.repeats < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--repeats and --rounds must be at least 1, --warmup at least 0")
    device = torch.device(args.device)
    n, v, d = (int(x) for x in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    xs = torch.randn(n, d, device=device).to(dtype).requires_grad_()
    ws = (torch.randn(v, d, device=device) * (3.0 / d**0.5)).to(dtype).requires_grad_()
    today = datetime.date.today().isoformat()
    common = {"date": today, "device": device_name(device), "torch": torch.__version__,
              "cuda": torch.version.cuda or "", "dtype": args.dtype, "N": n, "V": v, "D": d}
    teachers = {k: teacher_topk(xs, ws, k) for k in args.topk}
    specs = [{"method": "gemm", "normalize": "", "K": "", "mode": mode} for mode in ("forward", "fwd_bwd")]
    specs += [{"method": method, "normalize": normalize, "K": k, "mode": mode} for k in args.topk
              for normalize in ("full", "topk") for mode in ("forward", "fwd_bwd") for method in args.methods
              if not _training_only(method) or (mode == "fwd_bwd" and normalize == "full")]
    for spec in specs:
        spec["label"] = f"{spec['method']} {spec['normalize']} K={spec['K']} {spec['mode']}"

    def measure_one(spec):
        ids, lps = teachers.get(spec["K"], (None, None))
        try:
            return measure(spec["method"], spec["normalize"] or None, spec["mode"], xs, ws, ids, lps, args)
        except OOM_ERROR as e:
            return {"status": "oom", "error": short_error(e)}
        finally:
            free_device_memory(device)

    results = measure_rounds(specs, measure_one, args.rounds)
    floor = {spec["mode"]: result["median_ms"] for spec, result in zip(specs, results) if spec["method"] == "gemm"}
    rows = []
    for spec, result in zip(specs, results):
        row = {**common, **{k: spec[k] for k in ("method", "normalize", "K", "mode")}, "rounds": args.rounds, **result}
        if row["status"] == "ok":
            row["ratio_to_gemm"] = row["median_ms"] / floor[spec["mode"]]
        rows.append(row)
        print(f"{row['method']:9s} {row['normalize']:4s} K={row['K']!s:<4s} {row['mode']:8s} {row['status']:4s} "
              f"{row.get('median_ms', float('nan')):8.2f} ms {row.get('ratio_to_gemm', float('nan')):6.2f}x "
              f"{row.get('peak_extra_mib', float('nan')):9.1f} MiB")
    out = args.out or Path(__file__).parent / "results" / f"topk_linear_{args.device}_{today}.csv"
    write_csv(out, COLUMNS, rows)
    plot(rows, out)


if __name__ == "__main__":
    main()
