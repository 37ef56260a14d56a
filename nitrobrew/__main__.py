"""python -m nitrobrew: distill on a realistic problem with the fused loss and with the naive
(materialized-logits) computation, check they agree, and print loss, time and peak memory.

On CUDA the default problem is a Qwen-7B -> 14B-style step (V = 152064, D_s = 3584,
D_t = 5120, 4096 tokens, bf16); on the CPU a smaller one (V = 32000, D_s = 1024,
D_t = 1536, 512 tokens, float32). Every size is an option: python -m nitrobrew --help.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import nitrobrew
from nitrobrew import reference
from nitrobrew._extension import kernel_device_types

DEFAULTS = {
    "cuda": dict(tokens=4096, vocab=152064, d_student=3584, d_teacher=5120, dtype="bfloat16"),
    "cpu": dict(tokens=512, vocab=32000, d_student=1024, d_teacher=1536, dtype="float32"),
}
LOSSES = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m nitrobrew", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    parser.add_argument("--loss", choices=list(LOSSES), default="forward_kl")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--d-student", type=int)
    parser.add_argument("--d-teacher", type=int)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method (median reported)")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and "cuda" in kernel_device_types("fused_linear_fwd") else "cpu"
        if torch.cuda.is_available() and args.device == "cpu":
            print("note: a GPU is present but this build of nitrobrew has no CUDA kernels; running on the CPU")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


class PeakMemory:
    """Peak memory growth of a block: the CUDA allocator's peak on CUDA, the process's peak
    resident set (VmHWM, reset through /proc/self/clear_refs) on the CPU."""

    def __init__(self, device: str):
        self.device = device

    @staticmethod
    def _vm_hwm_bytes() -> int | None:
        try:
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def __enter__(self):
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            try:
                with open("/proc/self/clear_refs", "w") as clear_refs:
                    clear_refs.write("5")  # resets VmHWM to the current resident set
            except OSError:
                pass
            self.start = self._vm_hwm_bytes()
        return self

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            end = self._vm_hwm_bytes()
            self.peak = None if end is None or self.start is None else end - self.start


def make_problem(args):
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=args.device).manual_seed(0)
    kw = dict(device=args.device, dtype=dtype, generator=g)
    xs = torch.randn(args.tokens, args.d_student, **kw)
    xt = torch.randn(args.tokens, args.d_teacher, **kw)
    # Scaled so that logits have a spread like a trained model's (std ~ 4).
    ws = torch.randn(args.vocab, args.d_student, **kw) * (4.0 / args.d_student**0.5)
    wt = torch.randn(args.vocab, args.d_teacher, **kw) * (4.0 / args.d_teacher**0.5)
    labels = torch.randint(0, args.vocab, (args.tokens,), device=args.device, generator=g)
    labels[: args.tokens // 10] = -100  # some padding tokens
    return xs, xt, ws, wt, labels


def run(method, inputs, args):
    """Median fwd+bwd time of `method`, its loss and gradients, and its peak extra memory."""
    xs, xt, ws, wt, labels = inputs
    times, memory = [], None
    for repeat in range(args.repeats + 1):  # the first run warms up
        a, b = xs.detach().requires_grad_(), ws.detach().requires_grad_()
        with PeakMemory(args.device) as peak:
            start = time.perf_counter()
            loss = method(a, xt, b, wt, labels)
            loss.backward()
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        if repeat > 0:
            times.append(elapsed)
            memory = peak.peak if memory is None or peak.peak is None else max(memory, peak.peak)
        print(f"    run {repeat}/{args.repeats}{' (warm-up)' if repeat == 0 else ''}: {elapsed * 1e3:.1f} ms", flush=True)
    return sorted(times)[len(times) // 2], loss.detach(), a.grad, b.grad, memory


def relative_difference(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def main():
    args = parse_args()
    beta = LOSSES[args.loss]
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"nitrobrew {nitrobrew.__version__} on {device_name}, torch {torch.__version__}")
    print(f"problem: {args.loss} (temperature {args.temperature}), {args.tokens} tokens, vocabulary {args.vocab}, "
          f"D_s {args.d_student}, D_t {args.d_teacher}, {args.dtype}")
    print(f"  the materialized logits would take {2 * args.tokens * args.vocab * 4 / 2**30:.2f} GiB in float32")
    inputs = make_problem(args)

    def fused(xs, xt, ws, wt, labels):
        return nitrobrew.jsd(xs, xt, ws, wt, beta=beta, labels=labels, temperature=args.temperature)

    def naive(xs, xt, ws, wt, labels):  # logits materialized in float32
        return reference.fused_linear(xs, xt, ws, wt, beta=beta, labels=labels,
                                              temperature=args.temperature, dtype=torch.float32)

    results = {}
    for name, method in (("nitrobrew (fused)", fused), ("naive PyTorch (materialized fp32 logits)", naive)):
        print(f"  {name}: forward + backward", flush=True)
        try:
            results[name] = run(method, inputs, args)
        except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError):
            print("    out of memory")
            torch.cuda.empty_cache()

    print()
    print(f"{'method':45s} {'loss':>12s} {'fwd+bwd ms':>11s} {'peak extra GiB':>15s}")
    for name, (ms, loss, _, _, memory) in results.items():
        mem = "n/a" if memory is None else f"{memory / 2**30:.3f}"
        print(f"{name:45s} {loss.item():12.6f} {ms * 1e3:11.1f} {mem:>15s}")
    if len(results) == 2:
        (_, fused_loss, fused_dxs, fused_dws, _), (_, naive_loss, naive_dxs, naive_dws, _) = results.values()
        diffs = {"loss": relative_difference(fused_loss, naive_loss), "dxs": relative_difference(fused_dxs, naive_dxs),
                 "dws": relative_difference(fused_dws, naive_dws)}
        # Gradients come back in the inputs' dtype (and on CUDA from dLoss/dz rounded to it), so
        # the two agree to a few units of that dtype's rounding, not to float32's.
        tolerance = max(1e-4, 2 * torch.finfo(inputs[0].dtype).eps)
        ok = all(d < tolerance for d in diffs.values())
        print("relative difference fused vs naive: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())
              + (f" -> match (tolerance {tolerance:.0e})" if ok else f" -> MISMATCH (tolerance {tolerance:.0e})"))
        if not ok:
            raise SystemExit(1)
        (fused_ms, *_, fused_mem), (naive_ms, *_, naive_mem) = results.values()
        speed = (f"{naive_ms / fused_ms:.2f}x naive's speed" if fused_ms <= naive_ms else
                 f"{fused_ms / naive_ms - 1:.0%} slower than naive")
        memory = ("" if fused_mem is None or naive_mem is None else
                  f", {fused_mem / 2**30:.3f} GiB of extra peak memory against naive's {naive_mem / 2**30:.3f}")
        print(f"nitrobrew: {speed}{memory}.")
        if args.device == "cpu":
            print("On the CPU the fused path's gain is memory: in float32 its training step has measured about as fast "
                  "as naive PyTorch's (docs/performance.md) or faster (as above), by machine; with bf16 inputs "
                  "naive's bf16 products run 2-3x faster than nitrobrew's float32 ones (docs/performance.md has the "
                  "CPU measurements); its speed is won on GPUs.")

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
