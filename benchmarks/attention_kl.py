"""Benchmark nitrobrew.attention_kl against plain PyTorch and SDPA: N x causal x mode -> CSV (+ PNG plot).

    python benchmarks/attention_kl.py                      # CUDA: B=1, H=32, D=128, bf16, N = 1024 ... 65536
    python benchmarks/attention_kl.py --device cpu --n 128,200 --heads 2 --repeats 1 --out /tmp/akl.csv

Each row is one (method, N, causal, mode), with N_q = N_k = N and inputs in FlashAttention's [B, N, H, D]
layout: median and min time of `--repeats` runs after `--warmup` runs, the peak memory above what the
inputs hold, and the time as a ratio to `sdpa` at the same N, causal flag and mode. `sdpa` is
scaled_dot_product_attention as PyTorch dispatches it by default (the `backend` column names the kernels
it ran: on the H100 with torch 2.11, cuDNN's fused flash attention, 1.70 / 6.66 ms forward / forward +
backward at N = 8192); `sdpa_flash` forces PyTorch's own FlashAttention-2 backend, ~1.8x slower there.
The targets: at N = 8192, nitrobrew forward <= 1.3x and forward + backward <= 1.5x SDPA's; at
N = 65536, at most 1 GiB of extra memory. Memory is measured as in fused_linear.py: growth of
torch.cuda.max_memory_allocated on CUDA; on CPU every measurement runs in a fresh subprocess and reports
its peak RSS growth (VmHWM).

`nitrobrew_bhnd` is the same call on [B, H, N, D] inputs (layout="bhnd", read in place). `nitrobrew_fp32` is the same call on float32 inputs (on CUDA the exact float32 path: chunked float32
GEMMs, TF32 off); its `ratio_to_nitrobrew` column is its time over `nitrobrew`'s at the same N, causal flag
and mode, i.e. the price of float32 over --dtype (bf16 by default). Its rows above --fp32-max-n (default
16384) are skipped: at N = 65536 one run takes seconds.

A method is a function (x, *, causal, kind, reduction, deterministic) -> Tensor, where x maps input names
to tensors; register one with @method(name, inputs, grads, dtype=...).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import statistics
import subprocess
import traceback
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from harness import (
    OOM_ERROR, device_name, fmt, free_device_memory, measure_in_subprocess, measure_rounds, memory_baseline,
    peak_extra_mib, pyplot, short_error, time_runs,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

try:
    import nitrobrew
except Exception as e:  # noqa: BLE001 -- a broken build fails the nitrobrew rows, not the naive and sdpa ones
    nitrobrew, NITROBREW_IMPORT_ERROR = None, e

DEFAULT_N = {"cpu": [256, 512], "cuda": [1024, 4096, 8192, 16384, 32768, 65536]}
DEFAULT_HEADS = {"cpu": 4, "cuda": 32}
COLUMNS = [
    "date", "device", "driver", "torch", "cuda", "commit", "threads", "method", "kind", "deterministic", "mode",
    "causal", "dtype", "B", "H", "N", "D", "status", "median_ms", "min_ms", "peak_extra_mib", "memory_metric",
    "ratio_to_sdpa", "ratio_to_nitrobrew", "loss_value", "backend", "rounds", "round_medians_ms", "error",
]
# loss_value keeps full precision
ROUNDED = {"median_ms", "min_ms", "peak_extra_mib", "ratio_to_sdpa", "ratio_to_nitrobrew"}
INPUT_NAMES = ["q_s", "k_s", "q_t", "k_t", "v"]  # each drawn with its own seed: every method sees the same q_s, k_s


class Method(NamedTuple):
    fn: Callable
    inputs: tuple  # the input tensors it needs (only these are allocated, so the baseline is its own)
    grads: tuple  # what fwd_bwd differentiates with respect to
    is_loss: bool  # whether its output is a KL (reported as loss_value)
    dtype: str | None  # its inputs' dtype; None: the run's --dtype
    layout: str = "bnhd"  # its inputs' memory layout: [B, N, H, D] or [B, H, N, D] ("bhnd")


METHODS: dict[str, Method] = {}
KL_INPUTS = ("q_s", "k_s", "q_t", "k_t")


def method(name, inputs=KL_INPUTS, grads=("q_s", "k_s"), is_loss=True, dtype=None, layout="bnhd"):
    def register(fn):
        METHODS[name] = Method(fn, inputs, grads, is_loss, dtype, layout)
        return fn
    return register


def input_dtype(name, run_dtype):
    """The dtype of a method's inputs in a run whose --dtype is run_dtype."""
    return METHODS[name].dtype or run_dtype


@method("nitrobrew")
def _nitrobrew(x, *, causal, kind, reduction, deterministic):
    if nitrobrew is None:
        raise RuntimeError(f"import nitrobrew failed: {NITROBREW_IMPORT_ERROR!r}")
    return nitrobrew.attention_kl(x["q_s"], x["k_s"], x["q_t"], x["k_t"], causal=causal, kind=kind,
                                  reduction=reduction, deterministic=deterministic)


@method("nitrobrew_fp32", dtype="float32")
def _nitrobrew_fp32(x, **options):
    # float32 inputs: on CUDA the chunked path of exact float32 GEMMs instead of the 16-bit kernels.
    return _nitrobrew(x, **options)


@method("nitrobrew_bhnd", layout="bhnd")
def _nitrobrew_bhnd(x, *, causal, kind, reduction, deterministic):
    # [B, H, N, D] inputs (Hugging Face's and SDPA's), read in place through their strides.
    return nitrobrew.attention_kl(x["q_s"], x["k_s"], x["q_t"], x["k_t"], causal=causal, kind=kind,
                                  reduction=reduction, deterministic=deterministic, layout="bhnd")


def _naive_log_probs(q, k, hidden):
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, N, H, D] -> [B, H, N, D]
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # [B, H, N_q, N_k] in the input dtype
    if hidden is not None:
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.log_softmax(scores.float(), dim=-1)


@method("naive")
def _naive(x, *, causal, kind, reduction, deterministic):
    # Plain PyTorch as one would first write it: both score matrices materialized, log-softmax in float32.
    n_q, n_k = x["q_s"].shape[1], x["k_s"].shape[1]
    hidden = None
    if causal:  # aligned bottom-right, as FlashAttention: query i sees keys j <= i + N_k - N_q
        hidden = torch.ones(n_q, n_k, dtype=torch.bool, device=x["q_s"].device).triu_(n_k - n_q + 1)
    log_s, log_t = _naive_log_probs(x["q_s"], x["k_s"], hidden), _naive_log_probs(x["q_t"], x["k_t"], hidden)
    w, o = (log_t, log_s) if kind == "forward" else (log_s, log_t)  # KL(w || o) = sum exp(w) (w - o)
    diff = w - o
    if hidden is not None:
        diff = diff.masked_fill(hidden, 0.0)  # -inf - -inf is nan at hidden keys, whose weight exp(w) is 0
    per_row = (w.exp() * diff).sum(-1)  # [B, H, N_q]
    return per_row if reduction == "none" else per_row.mean()  # N_q = N_k here: every row sees a key


def _attention(x, causal, reduction):
    # Attention itself on the student's q, k (and a random v): the speed a fused attention kernel reaches.
    q, k, v = (x[name].transpose(1, 2) for name in ("q_s", "k_s", "v"))  # [B, N, H, D] -> [B, H, N, D] views
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return out if reduction == "none" else out.sum()


@method("sdpa", inputs=("q_s", "k_s", "v"), grads=("q_s", "k_s", "v"), is_loss=False)
def _sdpa(x, *, causal, kind, reduction, deterministic):
    return _attention(x, causal, reduction)  # whichever backend PyTorch picks: what a model's attention costs


@method("sdpa_flash", inputs=("q_s", "k_s", "v"), grads=("q_s", "k_s", "v"), is_loss=False)
def _sdpa_flash(x, *, causal, kind, reduction, deterministic):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # PyTorch's FlashAttention-2 kernels
        return _attention(x, causal, reduction)


def kernel_family(run, device):
    """Which attention kernels one call of `run` launches on CUDA (the SDPA backend that ran)."""
    if device.type != "cuda":
        return ""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA).lower()
    found = [family for family, key in (("cudnn", "cudnn"), ("flash", "flash_"), ("efficient", "fmha"))
             if key in names]
    return found[0] if found else "other"


def make_inputs(spec, m):
    device, dtype = torch.device(spec["device"]), getattr(torch, input_dtype(spec["method"], spec["dtype"]))
    shape = (spec["B"], spec["N"], spec["H"], spec["D"])
    if m.layout == "bhnd":
        shape = (spec["B"], spec["H"], spec["N"], spec["D"])
    x = {}
    for name in m.inputs:
        # N(0, 1) inputs with the default scale 1/sqrt(D) give scores about N(0, 1): KL(t || s) of order 1.
        gen = torch.Generator(device=device).manual_seed(INPUT_NAMES.index(name))
        x[name] = torch.randn(shape, generator=gen, dtype=dtype, device=device)
        x[name].requires_grad_(spec["mode"] == "fwd_bwd" and name in m.grads)
        x[name].detach().sum().item()  # touched, so resident before the memory baseline
    return x


def measure(spec):
    """One (method, N, causal, mode): status, times, peak memory and the loss (mean over rows)."""
    device, m = torch.device(spec["device"]), METHODS[spec["method"]]
    options = {"causal": spec["causal"], "kind": spec["kind"], "deterministic": spec["deterministic"]}
    last = {}

    def run():
        last.clear()  # the previous output is freed first, so it does not add to this run's peak
        if spec["mode"] == "fwd_bwd":
            out = m.fn(x, reduction="mean", **options)
            # autograd.grad hands back fresh gradients instead of accumulating: every run does the same work.
            torch.autograd.grad(out, [x[name] for name in m.grads])
        else:
            with torch.no_grad():
                out = m.fn(x, reduction="none", **options)
        if m.is_loss:
            last["out"] = out.detach()

    try:
        x = make_inputs(spec, m)
        baseline = memory_baseline(device)
        times = time_runs(run, device, spec["warmup"], spec["repeats"])
        extra = peak_extra_mib(device, baseline)
        backend = kernel_family(run, device) if spec["method"].startswith("sdpa") else ""
    except NotImplementedError as e:  # e.g. no kernel for this device yet: recorded, no traceback
        return {"status": "not_implemented", "error": short_error(e)}
    except Exception as e:  # noqa: BLE001 -- one failed row must not end the sweep; it is recorded
        # The CPU allocator raises a plain RuntimeError, not OutOfMemoryError, when malloc fails.
        if isinstance(e, OOM_ERROR) or "can't allocate memory" in str(e):
            return {"status": "oom", "error": short_error(e)}
        traceback.print_exc()
        return {"status": "error", "error": short_error(e)}
    return {
        "status": "ok",
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "peak_extra_mib": extra,
        "loss_value": last["out"].float().mean().item() if m.is_loss else "",
        "backend": backend,
    }


def driver_version(device):
    """The NVIDIA driver version (nvidia-smi, else /proc/driver/nvidia/version); "none" on CPU."""
    if device.type != "cuda":
        return "none"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if smi.returncode == 0 and smi.stdout.strip():
            return smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        found = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", Path("/proc/driver/nvidia/version").read_text())
        return found.group(1) if found else "unknown"
    except OSError:
        return "unknown"


def git_commit():
    # Which nitrobrew was measured; "-dirty" when the working tree has uncommitted changes.
    try:
        git = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=30)
        return git.stdout.strip() if git.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def add_ratios(rows):
    # Ratios to SDPA of the same N, causal flag and mode: absolute times only mean something within one run.
    # The nitrobrew variants (nitrobrew_fp32) are also compared with nitrobrew itself.
    def times(name):
        return {(r["N"], r["causal"], r["mode"]): r.get("median_ms") for r in rows
                if r["method"] == name and r["status"] == "ok"}

    sdpa, ours = times("sdpa"), times("nitrobrew")
    for r in rows:
        key = (r["N"], r["causal"], r["mode"])
        if r["status"] != "ok":
            continue
        if sdpa.get(key):
            r["ratio_to_sdpa"] = r["median_ms"] / sdpa[key]
        if r["method"].startswith("nitrobrew_") and ours.get(key):
            r["ratio_to_nitrobrew"] = r["median_ms"] / ours[key]


def write_csv(rows, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (round(v, 3) if k in ROUNDED and v != "" else v) for k, v in r.items()})


def print_table(rows):
    print(f"{'method':<15}{'mode':<9}{'causal':<8}{'N':>7}{'median ms':>11}{'min ms':>10}"
          f"{'peak MiB':>10}{'vs sdpa':>9}{'vs nb':>7}{'loss':>10}")
    for r in rows:
        numbers = (
            f"{fmt(r.get('median_ms'), '.2f'):>11}{fmt(r.get('min_ms'), '.2f'):>10}{fmt(r.get('peak_extra_mib')):>10}"
            f"{fmt(r.get('ratio_to_sdpa'), '.2f'):>9}{fmt(r.get('ratio_to_nitrobrew'), '.2f'):>7}"
            f"{fmt(r.get('loss_value'), '.5f'):>10}  {r.get('backend', '')}"
            if r["status"] == "ok" else f"  {r['status']}  {r.get('error', '')[:80]}"
        )
        print(f"{r['method']:<15}{r['mode']:<9}{str(r['causal']):<8}{r['N']:>7}" + numbers)


def print_targets(rows):
    """The three target numbers, where this run measured them."""
    ok = {(r["method"], r["N"], r["causal"], r["mode"]): r for r in rows if r["status"] == "ok"}
    for (name, n, causal, mode), r in ok.items():
        if name == "nitrobrew" and n == 8192 and r.get("ratio_to_sdpa"):
            target = 1.3 if mode == "forward" else 1.5
            print(f"target: nitrobrew {mode} causal={causal} N=8192: {r['ratio_to_sdpa']:.2f}x sdpa (<= {target}x)")
        if name == "nitrobrew" and n == 65536:
            extra = f"{r['peak_extra_mib']:.0f} MiB extra"
            if mode == "fwd_bwd":  # the gradients dq_s, dk_s are the op's outputs, as large as q_s, k_s
                grads = 2 * r["B"] * n * r["H"] * r["D"] * torch.tensor([], dtype=getattr(torch, r["dtype"])).element_size()
                extra += f", {r['peak_extra_mib'] - grads / 2**20:.0f} MiB beyond the gradients"
            print(f"target: nitrobrew {mode} causal={causal} N=65536: {extra} (<= 1024)")


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    if not any(r["status"] == "ok" for r in rows):
        print("no successful measurement: skipping the plot")
        return
    panels = list(dict.fromkeys((r["mode"], r["causal"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    ns = sorted({r["N"] for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 7), squeeze=False)
    for col, (mode, causal) in enumerate(panels):
        here = [r for r in rows if r["mode"] == mode and r["causal"] == causal]
        for row, (key, label) in enumerate([("median_ms", "median time (ms)"), ("peak_extra_mib", "peak extra (MiB)")]):
            ax = axes[row][col]
            for m in methods:
                ok = [r for r in here if r["method"] == m and r["status"] == "ok"]
                failed = [f"{r['N']} {r['status']}" for r in here if r["method"] == m and r["status"] != "ok"]
                label_m = m + (f" ({', '.join(failed)})" if failed else "")  # failed rows have no point
                ax.plot([r["N"] for r in ok], [max(r[key], 1e-3) for r in ok], "o-", label=label_m)
            if key == "median_ms":  # the speed target, drawn at every N as a guide
                target = 1.3 if mode == "forward" else 1.5
                sdpa = [r for r in here if r["method"] == "sdpa" and r["status"] == "ok"]
                ax.plot([r["N"] for r in sdpa], [target * r["median_ms"] for r in sdpa], "k:",
                        label=f"{target} x sdpa (target)")
            elif max(r["N"] for r in here) >= 65536:  # the memory target is about N = 65536 only
                ax.axhline(1024, color="k", linestyle=":", label="1 GiB (target at N=65536)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns], fontsize=7)
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("N (= N_q = N_k)")
            ax.set_ylabel(label)
            ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}")
            ax.legend(fontsize=7)
    r0 = rows[0]
    fig.suptitle(f"attention_kl ({r0['kind']} KL), B={r0['B']} H={r0['H']} D={r0['D']} {r0['dtype']}; {r0['device']}, "
                 f"torch {r0['torch']}, cuda {r0['cuda']}, driver {r0['driver']}, commit {r0['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_n(text):
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {text!r}")
    return values


def parse_args():
    has_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--modes", nargs="+", choices=["forward", "fwd_bwd"], default=["forward", "fwd_bwd"])
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--n", type=parse_n, help="N = N_q = N_k, comma-separated; default: cpu 256,512; "
                                             "cuda 1024,4096,8192,16384,32768,65536")
    p.add_argument("--kind", choices=["forward", "reverse"], default="forward", help="KL(t||s) or KL(s||t)")
    p.add_argument("--deterministic", action="store_true", help="passed to nitrobrew.attention_kl")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="default: 4 on cpu, 32 on cuda")
    p.add_argument("--dim", type=int, default=128, help="head dimension, student and teacher")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if has_cuda else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 cpu, bfloat16 cuda")
    p.add_argument("--repeats", type=int, help="default: 3 on cpu, 5 on cuda")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every (method, N, causal, mode) this many times, one round after another")
    p.add_argument("--warmup", type=int, help="default: 1 on cpu, 3 on cuda")
    p.add_argument("--fp32-max-n", type=int, default=16384, help="skip nitrobrew_fp32 rows with a larger N")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (cpu)")
    p.add_argument("--out", type=Path, help="CSV path; the plot goes beside it as .png")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON spec: measure once, print the result as JSON
    args = p.parse_args()
    if args.worker:
        return args
    if args.device == "cuda" and not has_cuda:
        p.error("--device cuda, but torch.cuda.is_available() is False")
    cpu = args.device == "cpu"
    args.n = args.n or DEFAULT_N[args.device]
    args.heads = args.heads or DEFAULT_HEADS[args.device]
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.repeats = args.repeats if args.repeats is not None else (3 if cpu else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    if args.repeats < 1 or args.rounds < 1 or args.warmup < 0 or min(args.batch, args.heads, args.dim) < 1:
        p.error("--repeats, --rounds, --batch, --heads and --dim must be at least 1, --warmup at least 0")
    return args


def main():
    args = parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        print(json.dumps(measure(spec)))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    today = datetime.date.today().isoformat()
    out = args.out or Path(__file__).resolve().parent / "results" / f"attention_kl_{device.type}_{today}.csv"
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    meta = {
        "date": today, "device": device_name(device), "driver": driver_version(device), "torch": torch.__version__,
        "cuda": torch.version.cuda or "none", "commit": git_commit(), "threads": torch.get_num_threads(),
        "kind": args.kind, "deterministic": args.deterministic, "dtype": args.dtype,
        "B": args.batch, "H": args.heads, "D": args.dim,
        "memory_metric": "cuda_max_allocated" if device.type == "cuda" else "cpu_process_peak_rss",
    }

    load_before = os.getloadavg()[0]
    specs = [{"method": name, "mode": mode, "causal": causal, "N": n, "B": args.batch, "H": args.heads, "D": args.dim,
              "dtype": args.dtype, "device": args.device, "kind": args.kind, "deterministic": args.deterministic,
              "warmup": args.warmup, "repeats": args.repeats, "threads": args.threads,
              "label": f"{name} {mode} causal={causal} N={n}"}
             for causal in causals for n in args.n for mode in args.modes for name in args.methods]

    def measure_one(spec):
        if spec["method"] == "nitrobrew_fp32" and spec["N"] > args.fp32_max_n:
            return {"status": "skipped", "error": f"N > --fp32-max-n {args.fp32_max_n}"}
        result = measure_in_subprocess(__file__, spec) if device.type == "cpu" else measure(spec)
        free_device_memory(device)
        return result

    rows = [{**meta, "method": spec["method"], "mode": spec["mode"], "causal": spec["causal"], "N": spec["N"],
             "dtype": input_dtype(spec["method"], args.dtype), "rounds": args.rounds, **result}
            for spec, result in zip(specs, measure_rounds(specs, measure_one, args.rounds))]

    add_ratios(rows)
    write_csv(rows, out)
    print(f"\n{meta['device']}, driver {meta['driver']}, torch {meta['torch']}, cuda {meta['cuda']}, "
          f"commit {meta['commit']}, {meta['threads']} threads; B={args.batch} H={args.heads} D={args.dim} "
          f"{args.dtype}, {args.kind} KL, deterministic={args.deterministic}; median of {args.repeats} after "
          f"{args.warmup} warm-up{f', median of {args.rounds} rounds' if args.rounds > 1 else ''}; "
          f"peak MiB = {meta['memory_metric']}")
    if device.type == "cpu":  # CPU timings are only as good as the machine was quiet
        print(f"1-minute load average before the runs: {load_before:.2f} on {os.cpu_count()} cores")
    print_table(rows)
    print_targets(rows)
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
