"""Benchmark the fused-linear distillation losses: methods x shapes x modes -> CSV (+ PNG plot).

    python benchmarks/fused_linear.py --loss forward_kl --repeats 5
    python benchmarks/fused_linear.py --device cpu --shape 512,32000,1024,1536 --modes forward

Each row is one (method, shape, mode): median and min wall time of `--repeats` runs after
`--warmup` runs, the peak memory above what the inputs hold, and the time as a ratio to the
`naive` method measured in the same invocation. peak_extra_mib is torch.cuda.max_memory_allocated
growth on CUDA; on CPU there is no allocator counter, so every measurement runs in a fresh
subprocess and reports that process's peak RSS growth (VmHWM), which includes the allocator's slack.

A method is a function (xs, xt, ws, wt, *, loss, reduction) -> Tensor; add one with @method("name").
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import statistics
import traceback
from pathlib import Path

import torch

import nitrobrew
from harness import (
    OOM_ERROR, device_name, fmt, measure_in_subprocess, measure_rounds, memory_baseline, peak_extra_mib, pyplot,
    time_runs,
)
from nitrobrew import reference

# Each loss's weight: JSD's beta, the skew KLs' alpha (the reference takes it as `beta`).
WEIGHTS = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5, "skew_forward_kl": 0.1, "skew_reverse_kl": 0.1, "tvd": 0.0}


def weight_of(loss):
    """The public function's weight keyword for a loss: {"beta": ...}, {"alpha": ...} or {}."""
    if loss == "jsd":
        return {"beta": WEIGHTS[loss]}
    return {"alpha": WEIGHTS[loss]} if loss.startswith("skew_") else {}
DEFAULT_SHAPES = {
    "cpu": (512, 32000, 1024, 1536),
    "cuda": (8192, 152064, 3584, 5120),  # the Qwen-7B -> 14B reference problem (docs/performance.md)
}
COLUMNS = [
    "date", "device", "torch", "cuda", "threads", "method", "loss", "mode", "dtype", "N", "V", "Ds", "Dt",
    "status", "median_ms", "min_ms", "peak_extra_mib", "memory_metric", "time_vs_naive", "time_vs_floor", "loss_value",
    "rounds", "round_medians_ms",
]
ROUNDED = {"median_ms", "min_ms", "peak_extra_mib", "time_vs_naive", "time_vs_floor"}  # loss_value keeps full precision

METHODS = {}


def method(name):
    def register(fn):
        METHODS[name] = fn
        return fn
    return register


@method("nitrobrew")
def _nitrobrew(xs, xt, ws, wt, *, loss, reduction):
    extra = weight_of(loss)
    return getattr(nitrobrew, loss)(xs, xt, ws, wt, reduction=reduction, **extra)


_BIASES = {}


def _model_options(ws, wt, *, bias, scale):
    """lm_head biases (the student's trained, as a model's is) and logit multipliers for the
    nitrobrew_bias / nitrobrew_scale methods: what these options cost against plain nitrobrew."""
    options = {}
    if bias:
        key = (ws.shape[0], wt.shape[0], ws.dtype, ws.device)
        if key not in _BIASES:
            _BIASES[key] = (torch.randn(ws.shape[0], dtype=ws.dtype, device=ws.device).requires_grad_(),
                            torch.randn(wt.shape[0], dtype=wt.dtype, device=wt.device))
        options.update(bias_s=_BIASES[key][0], bias_t=_BIASES[key][1])
    if scale:
        options.update(logit_scale_s=0.0625, logit_scale_t=0.25)  # Cohere's; Granite's 1 / logits_scaling
    return options


def _nitrobrew_path(xs, xt, ws, wt, *, loss, reduction, grad_in_forward, return_entropy=False):
    extra = weight_of(loss)
    if reduction == "none":  # the forward mode: both paths share the plain forward
        grad_in_forward = None
    out = getattr(nitrobrew, loss)(xs, xt, ws, wt, reduction=reduction, grad_in_forward=grad_in_forward,
                                   return_entropy=return_entropy, **extra)
    return out[0] if return_entropy else out


@method("nitrobrew_training")
def _nitrobrew_training(xs, xt, ws, wt, *, loss, reduction):
    # The training path (the gradients formed in the forward from chunks of float32 logits: four products).
    return _nitrobrew_path(xs, xt, ws, wt, loss=loss, reduction=reduction, grad_in_forward=True)


def _with_product_rows(rows):
    # The training path with steps of `rows` rows of products (PRODUCT_ROWS, 512): longer steps read the
    # weights fewer times per token, at more memory for the step's float32 products and less for G's chunk.
    def run(xs, xt, ws, wt, *, loss, reduction):
        from nitrobrew import _forward_grads

        previous, _forward_grads.PRODUCT_ROWS = _forward_grads.PRODUCT_ROWS, rows
        try:
            return _nitrobrew_path(xs, xt, ws, wt, loss=loss, reduction=reduction, grad_in_forward=True)
        finally:
            _forward_grads.PRODUCT_ROWS = previous
    return run


method("nitrobrew_training_steps_256")(_with_product_rows(256))
method("nitrobrew_training_steps_1024")(_with_product_rows(1024))


@method("nitrobrew_training_entropy")
def _nitrobrew_training_entropy(xs, xt, ws, wt, *, loss, reduction):
    # The training path with the student's entropy formed too (return_entropy=True; forward mode: the forward's).
    return _nitrobrew_path(xs, xt, ws, wt, loss=loss, reduction=reduction, grad_in_forward=True, return_entropy=True)


@method("nitrobrew_recompute_entropy")
def _nitrobrew_recompute_entropy(xs, xt, ws, wt, *, loss, reduction):
    return _nitrobrew_path(xs, xt, ws, wt, loss=loss, reduction=reduction, grad_in_forward=False,
                           return_entropy=True)


@method("nitrobrew_recompute")
def _nitrobrew_recompute(xs, xt, ws, wt, *, loss, reduction):
    # The recompute path (per-row statistics saved, the logits recomputed in the backward: six products).
    return _nitrobrew_path(xs, xt, ws, wt, loss=loss, reduction=reduction, grad_in_forward=False)


class _Composition(torch.autograd.Function):
    """What a user composes from nitrobrew's logits kernels in ~40 lines (issue 42's baseline): token
    chunks of 2048, both models' chunk logits from cuBLAS in bf16, dLoss/dz from nitrobrew.logits and
    autograd in the forward, dxs = dz . ws and dws += dz^T . xs (accumulated in the input dtype); the
    backward only scales the saved gradients."""

    chunk = 2048

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, loss_name):
        fn = getattr(nitrobrew.logits, loss_name)
        extra = weight_of(loss_name)
        dxs, dws = torch.empty_like(xs), torch.zeros_like(ws)
        total = torch.zeros((), device=xs.device)
        for c0 in range(0, xs.shape[0], _Composition.chunk):
            x = xs[c0:c0 + _Composition.chunk]
            zs = (x @ ws.T).requires_grad_()
            zt = xt[c0:c0 + _Composition.chunk] @ wt.T
            with torch.enable_grad():
                chunk_loss = fn(zs, zt, reduction="sum", **extra)
                (dz,) = torch.autograd.grad(chunk_loss, zs)
            del zs, zt
            dxs[c0:c0 + _Composition.chunk] = dz @ ws
            dws.addmm_(dz.T, x)
            total += chunk_loss.detach()
        n = max(xs.shape[0], 1)
        ctx.save_for_backward(dxs, dws)
        ctx.n = n
        return total / n

    @staticmethod
    def backward(ctx, grad):
        dxs, dws = ctx.saved_tensors
        scale = grad / ctx.n
        return dxs * scale, None, dws * scale, None, None


@method("composition")
def _composition(xs, xt, ws, wt, *, loss, reduction):
    if reduction == "none":  # the forward mode: the recipe is a training step; its forward is nitrobrew.logits'
        with torch.no_grad():
            extra = weight_of(loss)
            rows = [getattr(nitrobrew.logits, loss)(x @ ws.T, y @ wt.T, reduction="none", **extra)
                    for x, y in zip(xs.split(_Composition.chunk), xt.split(_Composition.chunk))]
            return torch.cat(rows)
    return _Composition.apply(xs, xt, ws, wt, loss)


@method("nitrobrew_bias")
def _nitrobrew_bias(xs, xt, ws, wt, *, loss, reduction):
    extra = weight_of(loss)
    return getattr(nitrobrew, loss)(xs, xt, ws, wt, reduction=reduction, **extra,
                                    **_model_options(ws, wt, bias=True, scale=False))


@method("nitrobrew_scale")
def _nitrobrew_scale(xs, xt, ws, wt, *, loss, reduction):
    extra = weight_of(loss)
    return getattr(nitrobrew, loss)(xs, xt, ws, wt, reduction=reduction, **extra,
                                    **_model_options(ws, wt, bias=False, scale=True))


@method("naive")
def _naive(xs, xt, ws, wt, *, loss, reduction):
    # dtype=None keeps the inputs' dtype: both [N, V] logit matrices are materialized, as plain PyTorch does.
    return reference.fused_linear(xs, xt, ws, wt, beta=WEIGHTS[loss], divergence=loss, reduction=reduction, dtype=None)


class _GemmFloor(torch.autograd.Function):
    """Only the matrix products any method must do: xs.ws^T and xt.wt^T forward, then
    dxs = G.ws and dws = G^T.xs backward (with the student logits standing in for G)."""

    @staticmethod
    def forward(ctx, xs, xt, ws, wt):
        zs, zt = xs @ ws.T, xt @ wt.T
        ctx.save_for_backward(xs, ws, zs)
        return zs[:, 0].float() + zt[:, 0].float()  # a per-row output at negligible cost

    @staticmethod
    def backward(ctx, grad):
        xs, ws, zs = ctx.saved_tensors
        return zs @ ws, None, zs.T @ xs, None


@method("cublas_gemms")
def _cublas_gemms(xs, xt, ws, wt, *, loss, reduction):
    per_row = _GemmFloor.apply(xs, xt, ws, wt)
    return per_row if reduction == "none" else per_row.mean()


class _StoredProductsFloor(torch.autograd.Function):
    """The training path's design with its row math replaced by ATen's memory-bound kernels: what the design
    costs if its row kernels ran at the speed of a reduction and a copy. Chunks of 4096 tokens, steps of 512
    rows of float32 products (nitrobrew::products, the path's own op), both read once (row maxima, for the
    statistics), then read again while G is written in the inputs' dtype (a copy of the student's products):
    the 26 bytes a column of docs/notes/fused_linear_training_path.md. Then dxs = G . ws and dws += G^T . xs
    per chunk, as the path does up to 4 chunks (its chunks are planned from the memory bound: 3 of 5632 tokens at
    N = 16384 on Llama-3, where this takes 4; past 4 it accumulates dws in float32). With reads=1 the first read is
    skipped: 18 bytes a column, the design whose statistics are folded into the products' epilogue at no cost. Its
    loss is a placeholder (not a divergence)."""

    chunk, step = 4096, 512

    @staticmethod
    def forward(ctx, xs, xt, ws, wt, reads):
        from nitrobrew._registration import ops

        vocab = ws.shape[0]
        dxs, dws = torch.empty_like(xs), torch.zeros_like(ws)
        total = torch.zeros((), device=xs.device)
        for c0 in range(0, xs.shape[0], _StoredProductsFloor.chunk):
            c1 = min(xs.shape[0], c0 + _StoredProductsFloor.chunk)
            g = torch.empty((c1 - c0, vocab), dtype=xs.dtype, device=xs.device)
            for r0 in range(c0, c1, _StoredProductsFloor.step):
                r1 = min(c1, r0 + _StoredProductsFloor.step)
                zs, zt = ops.products(xs[r0:r1], ws, vocab), ops.products(xt[r0:r1], wt, vocab)
                if reads == 2:
                    total += zs.amax(1).sum() - zt.amax(1).sum()  # pass 1: both read
                total += zt.amax(1).sum()  # pass 2: both read (again), G written
                g[r0 - c0:r1 - c0].copy_(zs)
                del zs, zt  # freed before the next step's products, as the path's are
            dxs[c0:c1] = g @ ws
            dws.addmm_(g.T, xs[c0:c1])
        ctx.save_for_backward(dxs, dws)
        return total / max(xs.shape[0], 1)

    @staticmethod
    def backward(ctx, grad):
        dxs, dws = ctx.saved_tensors
        return dxs * grad, None, dws * grad, None, None


def _floor_copy_rows(reads):
    def run(xs, xt, ws, wt, *, loss, reduction):
        if reduction == "none":  # a training step's floor: no forward mode (its row is recorded as "n/a")
            raise NotImplementedError("the floor_copy_rows methods are training steps (mode fwd_bwd)")
        return _StoredProductsFloor.apply(xs, xt, ws, wt, reads)
    return run


method("floor_copy_rows")(_floor_copy_rows(2))
method("floor_copy_rows_once")(_floor_copy_rows(1))


@torch.compile(dynamic=False)
def _fold_chunk(zs, zt, m_s, l_s, m_t, l_t, a):
    # Online forward-KL state over one vocabulary chunk: a = sum exp(t - m_t) (t - s).
    zs, zt = zs.float(), zt.float()
    new_m_s = torch.maximum(m_s, zs.amax(-1))
    new_m_t = torch.maximum(m_t, zt.amax(-1))
    e_t = torch.exp(zt - new_m_t[:, None])
    scale_t = torch.exp(m_t - new_m_t)
    l_s = l_s * torch.exp(m_s - new_m_s) + torch.exp(zs - new_m_s[:, None]).sum(-1)
    a = a * scale_t + (e_t * (zt - zs)).sum(-1)
    l_t = l_t * scale_t + e_t.sum(-1)
    return new_m_s, l_s, new_m_t, l_t, a


@torch.compile(dynamic=False)
def _grad_chunk(zs, zt, lse_s, lse_t, g):
    return (g[:, None] * (torch.exp(zs.float() - lse_s[:, None]) - torch.exp(zt.float() - lse_t[:, None]))).to(zs.dtype)


class _ChunkedForwardKL(torch.autograd.Function):
    """The usual fused-loss recipe in plain PyTorch: vocabulary chunks of bf16 logits, an online
    softmax compiled with torch.compile, and a backward that recomputes each chunk."""

    chunk = 8192

    @staticmethod
    def forward(ctx, xs, xt, ws, wt):
        n = xs.shape[0]
        m_s = torch.full((n,), -float("inf"), device=xs.device)
        m_t, l_s, l_t, a = m_s.clone(), torch.zeros_like(m_s), torch.zeros_like(m_s), torch.zeros_like(m_s)
        for c0 in range(0, ws.shape[0], _ChunkedForwardKL.chunk):
            zs, zt = xs @ ws[c0:c0 + _ChunkedForwardKL.chunk].T, xt @ wt[c0:c0 + _ChunkedForwardKL.chunk].T
            m_s, l_s, m_t, l_t, a = _fold_chunk(zs, zt, m_s, l_s, m_t, l_t, a)
        lse_s, lse_t = m_s + l_s.log(), m_t + l_t.log()
        ctx.save_for_backward(xs, xt, ws, wt, lse_s, lse_t)
        return a / l_t - lse_t + lse_s

    @staticmethod
    def backward(ctx, grad):
        xs, xt, ws, wt, lse_s, lse_t = ctx.saved_tensors
        dxs, dws = torch.zeros_like(xs, dtype=torch.float32), torch.empty_like(ws)
        for c0 in range(0, ws.shape[0], _ChunkedForwardKL.chunk):
            w_s = ws[c0:c0 + _ChunkedForwardKL.chunk]
            g = _grad_chunk(xs @ w_s.T, xt @ wt[c0:c0 + _ChunkedForwardKL.chunk].T, lse_s, lse_t, grad.float())
            dxs += (g @ w_s).float()
            dws[c0:c0 + _ChunkedForwardKL.chunk] = g.T @ xs
        return dxs.to(xs.dtype), None, dws, None


@method("chunked_compile")
def _chunked_compile(xs, xt, ws, wt, *, loss, reduction):
    if loss != "forward_kl":
        raise NotImplementedError("the chunked torch.compile baseline implements forward KL only")
    per_row = _ChunkedForwardKL.apply(xs, xt, ws, wt)
    return per_row if reduction == "none" else per_row.mean()


@method("liger")
def _liger(xs, xt, ws, wt, *, loss, reduction):
    # liger-kernel's fused linear JSD (its beta 0 / 1 are forward / reverse KL); it returns the mean only.
    from liger_kernel.transformers import LigerFusedLinearJSD

    beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": WEIGHTS["jsd"]}[loss]  # a KeyError: no liger counterpart
    return LigerFusedLinearJSD(jsd_beta=beta)(xs, ws, xt, wt, None)


def make_inputs(shape, dtype, device, requires_grad):
    n, v, ds, dt = shape
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(rows, cols, std=1.0):
        # Drawn straight in `dtype` and scaled in place: no float32 temporaries to inflate the RSS baseline.
        return torch.randn(rows, cols, generator=gen, dtype=dtype, device=device).mul_(std)

    # x ~ N(0, 1) and W ~ N(0, 1/D) give logits ~ N(0, 1): a realistic spread, KL(q || p) near 1.
    xs, xt = randn(n, ds), randn(n, dt)
    ws, wt = randn(v, ds, ds ** -0.5), randn(v, dt, dt ** -0.5)
    return xs.requires_grad_(requires_grad), xt, ws.requires_grad_(requires_grad), wt


def measure(spec):
    """One (method, shape, mode): returns status, times, peak memory and the loss (mean over tokens)."""
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    fn, loss, fwd_bwd = METHODS[spec["method"]], spec["loss"], spec["mode"] == "fwd_bwd"
    last = {}

    def run():
        if fwd_bwd:
            out = fn(xs, xt, ws, wt, loss=loss, reduction="mean")
            # autograd.grad hands back fresh gradients instead of accumulating: every run does the same work.
            torch.autograd.grad(out, (xs, ws), torch.ones_like(out))
        else:
            with torch.no_grad():
                out = fn(xs, xt, ws, wt, loss=loss, reduction="none")
        last["out"] = out.detach()

    try:
        xs, xt, ws, wt = make_inputs(spec["shape"], dtype, device, requires_grad=fwd_bwd)
        for t in (xs, xt, ws, wt):  # touch every input so it is resident before the memory baseline
            t.detach().sum().item()
        baseline = memory_baseline(device)
        times = time_runs(run, device, spec["warmup"], spec["repeats"])
        extra = peak_extra_mib(device, baseline)
    except NotImplementedError:  # a method without this mode (floor_copy_rows' forward)
        return {"status": "n/a"}
    except Exception as e:  # noqa: BLE001 -- one failed row must not end the sweep; it is recorded
        # The CPU allocator raises a plain RuntimeError, not OutOfMemoryError, when malloc fails.
        if isinstance(e, OOM_ERROR) or "can't allocate memory" in str(e):
            return {"status": "oom"}
        traceback.print_exc()
        return {"status": "error"}
    return {
        "status": "ok",
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "peak_extra_mib": extra,
        "loss_value": last["out"].float().mean().item(),
    }


def print_table(rows):
    print(f"{'method':<20}{'loss':<16}{'mode':<9}{'(N, V, Ds, Dt)':<26}{'median ms':>11}{'min ms':>10}"
          f"{'peak MiB':>10}{'vs naive':>10}{'vs floor':>10}{'loss':>10}")
    for r in rows:
        numbers = (
            f"{fmt(r.get('median_ms')):>11}{fmt(r.get('min_ms')):>10}{fmt(r.get('peak_extra_mib')):>10}"
            f"{fmt(r.get('time_vs_naive'), '.3f'):>10}{fmt(r.get('time_vs_floor'), '.3f'):>10}"
            f"{fmt(r.get('loss_value'), '.5f'):>10}"
            if r["status"] == "ok" else f"{r['status']:>11}"
        )
        print(f"{r['method']:<20}{r['loss']:<16}{r['mode']:<9}{str(r['shape']):<26}" + numbers)


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if r["status"] == "ok"]
    if not rows:
        print("no successful measurement: skipping the plot")
        return
    losses = list(dict.fromkeys(r["loss"] for r in rows))
    for r in rows:  # one bar per method, or per (method, loss) where several losses ran
        r["bar"] = r["method"] if len(losses) == 1 else f"{r['method']} {r['loss']}"
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    methods = list(dict.fromkeys(r["bar"] for r in rows))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 7), squeeze=False)
    width = 0.8 / len(methods)
    for col, mode in enumerate(modes):
        for row, (key, label) in enumerate([("median_ms", "median time (ms)"), ("peak_extra_mib", "peak extra (MiB)")]):
            ax = axes[row][col]
            for i, m in enumerate(methods):
                vals = {r["shape"]: r[key] for r in rows if r["bar"] == m and r["mode"] == mode}
                heights = [vals.get(s, 0.0) for s in shapes]  # a failed row draws as an empty slot
                ax.bar([j + i * width for j in range(len(shapes))], heights, width, label=m)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
            ax.set_xticklabels([f"N={n} V={v}\nDs={ds} Dt={dt}" for n, v, ds, dt in shapes], fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{' / '.join(losses)} {mode} ({rows[0]['dtype']})")
            ax.legend(fontsize=8)
    fig.suptitle(f"{rows[0]['device']}, torch {rows[0]['torch']}, {rows[0]['threads']} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def parse_shape(text):
    parts = tuple(int(p) for p in text.split(","))
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected N,V,Ds,Dt (four positive ints), got {text!r}")
    return parts


def main():
    has_cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--modes", nargs="+", choices=["forward", "fwd_bwd"], default=["forward", "fwd_bwd"])
    p.add_argument("--loss", nargs="+", choices=list(WEIGHTS), default=["forward_kl"],
                   help="one or more losses, alternated with the methods over the rounds")
    p.add_argument("--shape", type=parse_shape, action="append", help="N,V,Ds,Dt (repeatable)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if has_cuda else "cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 cpu, bfloat16 cuda")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every (method, shape, mode) this many times, one round after another")
    p.add_argument("--warmup", type=int, help="default: 1 on cpu (runs take seconds), 3 on cuda")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (cpu)")
    p.add_argument("--out", type=Path, help="CSV path; the plot goes beside it as .png")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # JSON spec: measure once, print the result as JSON
    args = p.parse_args()

    if args.worker:
        spec = json.loads(args.worker)
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        print(json.dumps(measure(spec)))
        return
    if args.repeats < 1 or args.rounds < 1 or (args.warmup or 0) < 0:
        p.error("--repeats and --rounds must be at least 1, --warmup at least 0")
    if args.device == "cuda" and not has_cuda:
        p.error("--device cuda, but torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    shapes = args.shape or [DEFAULT_SHAPES[device.type]]
    today = datetime.date.today().isoformat()
    out = args.out or Path(__file__).resolve().parent / "results" / f"fused_linear_{device.type}_{today}.csv"
    meta = {
        "date": today, "device": device_name(device), "torch": torch.__version__,
        "cuda": torch.version.cuda or "none", "threads": torch.get_num_threads(),
        "dtype": dtype,
        "memory_metric": "cuda_max_allocated" if device.type == "cuda" else "cpu_process_peak_rss",
    }

    load_before = os.getloadavg()[0]
    specs = [{"method": name, "loss": loss, "mode": mode, "shape": shape, "dtype": dtype, "device": args.device,
              "warmup": warmup, "repeats": args.repeats, "threads": args.threads,
              "label": f"{name} {loss} {mode} N,V,Ds,Dt={shape} {dtype}"}
             for shape in shapes for mode in args.modes for loss in args.loss for name in args.methods]

    def measure_one(spec):
        result = measure_in_subprocess(__file__, spec) if device.type == "cpu" else measure(spec)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # an oom must not leave cached blocks that skew the next row
        return result

    rows = [{**meta, "method": spec["method"], "loss": spec["loss"], "mode": spec["mode"], "shape": spec["shape"],
             "rounds": args.rounds, **result} for spec, result in zip(specs, measure_rounds(specs, measure_one, args.rounds))]

    # Ratios to the naive method and to the cuBLAS floor (the products alone: two forward, four fwd + bwd) of
    # the same shape and mode: absolute times only mean something in one run.
    for base_method, column in (("naive", "time_vs_naive"), ("cublas_gemms", "time_vs_floor")):
        base = {(r["shape"], r["mode"], r["loss"]): r.get("median_ms") for r in rows if r["method"] == base_method}
        for r in rows:
            if r["status"] == "ok" and base.get((r["shape"], r["mode"], r["loss"])):
                r[column] = r["median_ms"] / base[(r["shape"], r["mode"], r["loss"])]

    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, restval="", extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({**{k: (round(v, 3) if k in ROUNDED else v) for k, v in r.items()},
                             **dict(zip(("N", "V", "Ds", "Dt"), r["shape"]))})
    print(f"\n{meta['device']}, torch {meta['torch']}, cuda {meta['cuda']}, {meta['threads']} threads, "
          f"{' '.join(args.loss)}, {dtype}, median of {args.repeats} after {warmup} warm-up"
          f"{f', median of {args.rounds} rounds' if args.rounds > 1 else ''}; peak MiB = {meta['memory_metric']}")
    if device.type == "cpu":  # CPU timings are only as good as the machine was quiet
        print(f"1-minute load average before the runs: {load_before:.2f} on {os.cpu_count()} cores")
    print_table(rows)
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
