"""Benchmark the logit-level losses (nitrobrew.logits): methods x losses x modes -> CSV.

    python benchmarks/logits.py                       # CUDA: N x V = 8192 x 152064 bf16
    python benchmarks/logits.py --device cpu --shape 256,32000 --dtype float32

The logits exist before the timed region (they are the input); each run computes the loss (mode
"forward", under no_grad) or the loss and dLoss/dzs (mode "fwd_bwd"). Methods, in one run:
  nitrobrew  nitrobrew.logits.forward_kl / reverse_kl / jsd / skew_forward_kl / skew_reverse_kl / tvd;
  naive      PyTorch: float32 log_softmax of both, then the divergence (F.kl_div; JSD as its definition);
  liger      liger-kernel's LigerKLDIVLoss (forward / reverse KL) or LigerJSD on log_softmax outputs
             (the log-probabilities those losses take), where liger_kernel is installed;
  copy       one copy of an [N, V] tensor in the logits' dtype: the device's copy bandwidth.
With --topk K ..., also nitrobrew.logits.topk_kl (normalize="full") against the teacher's top-K of
the same logits, and naive PyTorch for it (float32 log_softmax of the student, gather, the K terms);
--topk-renormalized DIVERGENCE ... adds normalize="topk" with those divergences (loss "topk<K>:<divergence>";
naive: forward KL of the K gathered logits, log_softmax over them; no bytes model: it reads K logits a row).
A bar plot of the times goes beside the CSV (--replot CSV draws it for a CSV already written).
--rounds R times every case R times, the copy first in each round, methods alternated within it; --dtype takes
several dtypes. Columns: median over the rounds of each round's median of --repeats runs after --warmup (min: the
fastest run), peak memory above the inputs (MiB), the
bytes nitrobrew's kernels must move (forward: both logit matrices once, JSD, the skew KLs and TVD twice; backward: both
again and dzs written) and, for nitrobrew, those bytes per second as a fraction of the copy's.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import nitrobrew
from nitrobrew import reference
from harness import OOM_ERROR, device_name, free_device_memory, grouped_bars, memory_baseline, peak_extra_mib, pyplot
from harness import save_figure, short_error, time_runs, write_csv

# Each loss with its weight (JSD's beta, the skew KLs' alpha).
LOSSES = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5, "skew_forward_kl": 0.1, "skew_reverse_kl": 0.1, "tvd": 0.0}
SECOND_PASS = ("jsd", "skew_forward_kl", "skew_reverse_kl", "tvd")  # their forward reads both matrices twice
COLUMNS = ["date", "device", "torch", "cuda", "method", "loss", "mode", "dtype", "N", "V", "status", "rounds", "median_ms",
           "min_ms", "runs", "peak_extra_mib", "bytes_moved", "gb_per_s", "fraction_of_copy"]


def nitrobrew_loss(zs, zt, loss):
    if loss == "jsd":
        return nitrobrew.logits.jsd(zs, zt, beta=LOSSES["jsd"])
    if loss.startswith("skew_"):
        return getattr(nitrobrew.logits, loss)(zs, zt, alpha=LOSSES[loss])
    return getattr(nitrobrew.logits, loss)(zs, zt)


def naive_loss(zs, zt, loss):
    log_p, log_q = F.log_softmax(zs.float(), -1), F.log_softmax(zt.float(), -1)
    if loss == "forward_kl":
        return F.kl_div(log_p, log_q, log_target=True, reduction="batchmean")
    if loss == "reverse_kl":
        return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")
    if loss != "jsd":  # the skew KLs and TVD as nitrobrew.reference writes them, in float32
        return reference.divergence_from_logits(zs.float(), zt.float(), LOSSES[loss], loss).mean()
    beta = LOSSES["jsd"]
    log_m = torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))
    return (beta * F.kl_div(log_m, log_q, log_target=True, reduction="batchmean")
            + (1 - beta) * F.kl_div(log_m, log_p, log_target=True, reduction="batchmean"))


def liger_loss(zs, zt, loss):
    from liger_kernel.transformers import LigerJSD, LigerKLDIVLoss

    log_p, log_q = F.log_softmax(zs, -1), F.log_softmax(zt, -1)
    if loss == "jsd":  # liger's JSD(beta) is beta KL(P||M) + (1 - beta) KL(Q||M) with P the teacher
        return LigerJSD(beta=LOSSES["jsd"])(log_p, log_q)
    if loss not in ("forward_kl", "reverse_kl"):
        raise NotImplementedError(f"no liger-kernel counterpart of {loss} here")
    kl = LigerKLDIVLoss(reduction="batchmean", log_target=True)  # KL(target || input)
    return kl(log_p, log_q) if loss == "forward_kl" else kl(log_q, log_p)


METHODS = {"nitrobrew": nitrobrew_loss, "naive": naive_loss, "liger": liger_loss}


def topk_methods(ids, lps, divergence=None):
    """normalize="full" (divergence None), or "topk" with that divergence (weights at their defaults)."""
    def nitrobrew_topk(zs, zt, loss):
        if divergence is None:
            return nitrobrew.logits.topk_kl(zs, ids, lps, normalize="full")
        return nitrobrew.logits.topk_kl(zs, ids, lps, normalize="topk", divergence=divergence)

    def naive_topk(zs, zt, loss):
        if divergence is None:
            log_p, log_q = F.log_softmax(zs.float(), -1).gather(-1, ids), lps
        else:
            log_p, log_q = F.log_softmax(zs.float().gather(-1, ids), -1), F.log_softmax(lps, -1)
        return (log_q.exp() * (log_q - log_p)).sum(-1).mean()

    return {"nitrobrew": nitrobrew_topk, "naive": naive_topk}


def bytes_moved(loss, mode, n, v, elem):
    matrix = n * v * elem
    if ":" in loss:  # normalize="topk": K logits a row, and dzs written (no bandwidth to compare)
        return None
    if loss.startswith("topk"):  # the student's logits once, then again and dzs written
        return matrix + (2 * matrix if mode == "fwd_bwd" else 0)
    forward = (4 if loss in SECOND_PASS else 2) * matrix
    return forward + (3 * matrix if mode == "fwd_bwd" else 0)


def measure(method, loss, mode, zs, zt, args, methods=METHODS):
    device = zs.device
    if method == "copy":
        dst = torch.empty_like(zs)
        run = lambda: dst.copy_(zs)  # noqa: E731
    else:
        fn = methods[method]

        def run():
            if mode == "forward":
                with torch.no_grad():
                    return fn(zs, zt, loss)
            zs.grad = None
            fn(zs, zt, loss).backward()

    zs.grad = None  # a gradient left by the previous measurement would hide this one's
    base = memory_baseline(device)
    times = time_runs(run, device, args.warmup, args.repeats, args.min_seconds)
    return {"status": "ok", "median_ms": statistics.median(times), "min_ms": min(times), "runs": len(times),
            "peak_extra_mib": peak_extra_mib(device, base)}


def plot(rows, out):
    """Median time per (loss, mode) and method, log scale; the copy's time as a line."""
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in rows if r.get("status") == "ok" and r["method"] != "copy"]
    cases = list(dict.fromkeys((r["loss"], r["mode"]) for r in ok))
    series = {method: [next((float(r["median_ms"]) for r in ok if (r["loss"], r["mode"]) == case
                             and r["method"] == method), 0) for case in cases]
              for method in dict.fromkeys(r["method"] for r in ok)}
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cases)), 4))
    grouped_bars(ax, [f"{loss}\n{mode}" for loss, mode in cases], series, fontsize=7)
    copy = [float(r["median_ms"]) for r in rows if r["method"] == "copy" and r.get("status") == "ok"]
    if copy:
        ax.axhline(copy[0], color="black", linewidth=0.8, label="one copy of [N, V]")
    ax.set_ylabel("median ms")
    ax.legend(fontsize=8)
    save_figure(fig, out)


def sweep(args, device, n, v, dtype, today):
    """Every case of one dtype over args.rounds rounds, each round timing the copy first: one row per case, its
    median over the rounds (fraction_of_copy: the median of each round's fraction, against that round's copy)."""
    torch.manual_seed(0)
    zt = (torch.randn(n, v, device=device) * 2).to(dtype)
    zs = (zt.float() + torch.randn(n, v, device=device)).to(dtype).requires_grad_()
    common = {"date": today, "device": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda or "",
              "dtype": str(dtype).removeprefix("torch."), "N": n, "V": v}
    cases = [(loss, METHODS, args.methods) for loss in args.losses]
    for k in args.topk:
        lps, ids = torch.log_softmax(zt.float(), -1).topk(k, dim=-1)
        cases.append((f"topk{k}", topk_methods(ids, lps), [m for m in args.methods if m != "liger"]))
        for divergence in args.topk_renormalized:
            cases.append((f"topk{k}:{divergence}", topk_methods(ids, lps, divergence),
                          [m for m in args.methods if m != "liger"]))
    copy_bytes = 2 * n * v * zs.element_size()
    results = {}  # (method, loss, mode) -> one result a round, with the round's copy bandwidth
    for r in range(args.rounds):
        copy = measure("copy", "", "copy", zs.detach(), zt, args)
        copy_gbs = copy_bytes / copy["median_ms"] / 1e6
        results.setdefault(("copy", "", "copy"), []).append((copy, copy_gbs))
        print(f"{dtype} round {r + 1}/{args.rounds}: copy {copy['median_ms']:.2f} ms, {copy_gbs:.0f} GB/s")
        for loss, methods, names in cases:
            for mode in ("forward", "fwd_bwd"):
                for method in names:
                    try:
                        res = measure(method, loss, mode, zs, zt, args, methods)
                    except OOM_ERROR as e:
                        res = {"status": "oom", "error": short_error(e)}
                    except Exception as e:  # noqa: BLE001 (a missing peer is reported, the sweep goes on)
                        res = {"status": "error", "error": short_error(e)}
                        print(f"{method} {loss} {mode}: {res['error']}")
                    free_device_memory(device)
                    results.setdefault((method, loss, mode), []).append((res, copy_gbs))
    rows = []
    for (method, loss, mode), runs in results.items():
        row = {**common, "method": method, "loss": loss, "mode": mode, "rounds": len(runs)}
        ok = [(res, gbs) for res, gbs in runs if res["status"] == "ok"]
        if len(ok) < len(runs):
            row.update(status=next(res["status"] for res, _ in runs if res["status"] != "ok"))
            rows.append(row)
            continue
        medians = [res["median_ms"] for res, _ in ok]
        row.update(status="ok", median_ms=statistics.median(medians), min_ms=min(res["min_ms"] for res, _ in ok),
                   runs=sum(res["runs"] for res, _ in ok), peak_extra_mib=max(res["peak_extra_mib"] for res, _ in ok))
        moved = copy_bytes if method == "copy" else bytes_moved(loss, mode, n, v, zs.element_size())
        if method in ("nitrobrew", "copy") and moved is not None:
            row.update(bytes_moved=moved, gb_per_s=moved / row["median_ms"] / 1e6,
                       fraction_of_copy=statistics.median(moved / res["median_ms"] / 1e6 / gbs for res, gbs in ok))
        rows.append(row)
        print(f"{method:10s} {loss:16s} {mode:8s} {row['median_ms']:8.2f} ms  {row['peak_extra_mib']:9.1f} MiB"
              + (f"  {row['fraction_of_copy']:.2f} of copy" if "fraction_of_copy" in row else "")
              + (f"  (rounds {min(medians):.2f}-{max(medians):.2f})" if len(medians) > 1 else ""))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    has_cuda = torch.cuda.is_available()
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if has_cuda else "cpu")
    p.add_argument("--shape", default="8192,152064", help="N,V")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16", "float16"], default=["bfloat16"])
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds over every case, the copy first in each; medians over the rounds")
    p.add_argument("--losses", nargs="+", choices=list(LOSSES), default=list(LOSSES))
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-seconds", type=float, default=0.0,
                   help="time at least as many runs as fill this long (more than --repeats for fast calls)")
    p.add_argument("--topk", type=int, nargs="*", default=[], help="also top-K losses with these K")
    p.add_argument("--topk-renormalized", nargs="*", default=[], metavar="DIVERGENCE",
                   help='with --topk, also normalize="topk" with these divergences')
    p.add_argument("--out", type=Path)
    p.add_argument("--replot", type=Path, help="only draw the plot of this CSV (beside it, as .png)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.replot:
        with open(args.replot) as f:
            plot(list(csv.DictReader(f)), args.replot)
        return
    device = torch.device(args.device)
    n, v = (int(x) for x in args.shape.split(","))
    today = datetime.date.today().isoformat()
    rows = []
    for dtype_name in args.dtype:
        rows += sweep(args, device, n, v, getattr(torch, dtype_name), today)
    out = args.out or Path(__file__).parent / "results" / f"logits_{args.device}_{today}.csv"
    write_csv(out, COLUMNS, rows)
    plot(rows, out)


if __name__ == "__main__":
    main()
