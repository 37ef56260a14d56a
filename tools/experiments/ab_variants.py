"""Same-process A/B timing of kernel variants selected by environment variables (which the
extension reads at each launch), in alternation and beside a same-process baseline, so
that clocks, temperature and the power cap weigh on every variant alike:

    python tools/experiments/ab_variants.py attention --variants none NITROBREW_X=1 --out ab.csv
    python tools/experiments/ab_variants.py fused_linear --variants none NITROBREW_Y=1 --out ab.csv

A variant is `none` or assignments joined by '+' (attention: NITROBREW_AB_DETERMINISTIC=1 is read by
this script itself and passes deterministic=True). Each round times every method (the baseline and
peers, then each variant, the variants' order rotating from round to round) `--iters` times back to back, forward alone and forward + backward; the CSV has
the median over rounds of each round's median, the ratio to the baseline's, and checksums of the loss
and (twice) of the gradients (variants that must not change results have equal checksums).
- attention: attention_kl against SDPA as PyTorch dispatches it (q, k, v gradients; --peers adds
  the FlashAttention-2 backend), B = 1, bf16, causal and not, N from --n (default 8192), H = 32, D = 128.
- fused_linear: forward KL against the cuBLAS products of benchmarks/fused_linear.py's floor
  (--peers adds its chunked torch.compile baseline), on the Qwen reference shape (V = 152064,
  D_s = 3584, D_t = 5120; N from --n); fused_linear_llama: the same on Llama-3's shape (V = 128256,
  D_s = 2048, D_t = 4096).
- topk_linear: nitrobrew.topk_kl (normalize="full") for K = 32, 128 and 512 (the CSV's `case`) against
  the cuBLAS products of benchmarks/topk_linear.py's floor, with its inputs (V = 152064, D = 3584; the
  teacher's top-K of the student's logits plus noise).
- logits: nitrobrew.logits' forward_kl, jsd and topk_kl (K = 128) from [N, 152064] bf16 logits (the
  CSV's `case`) against PyTorch's forward KL on the materialized float32 log-probabilities.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import nitrobrew

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def timed(fn, iters: int) -> float:
    """Median milliseconds of `iters` calls, each between CUDA events."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def attention_problem(n: int, causal: bool, peers: bool):
    """({baseline and peers: (forward, step)}, ours forward, ours step -> gradients)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shape = (1, n, 32, 128)
    q_s, k_s, q_t, k_t, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(5))
    for x in (q_s, k_s, v):
        x.requires_grad_(True)
    grad_out = torch.randn(shape, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    def sdpa(backends=None):
        def run():
            q, k, vv = (x.transpose(1, 2) for x in (q_s, k_s, v))
            if backends is None:
                return F.scaled_dot_product_attention(q, k, vv, is_causal=causal)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, vv, is_causal=causal)
        return torch.no_grad()(run), lambda: torch.autograd.grad(run(), (q_s, k_s, v), grad_out)

    def ours_step():  # NITROBREW_AB_DETERMINISTIC=1 as a variant: the deterministic backward
        deterministic = os.environ.get("NITROBREW_AB_DETERMINISTIC") == "1"
        loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=causal, deterministic=deterministic)
        return torch.autograd.grad(loss, (q_s, k_s))

    others = {"sdpa": sdpa()}  # as PyTorch dispatches it (cuDNN's attention on the H100)
    if peers:
        others["sdpa_flash"] = sdpa([SDPBackend.FLASH_ATTENTION])
    return (others, torch.no_grad()(lambda: nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=causal,
                                                                   reduction="none")), ours_step)


def fused_linear_problem(n: int, causal: bool, peers: bool, vocab=152064, d_s=3584, d_t=5120):
    from fused_linear import METHODS, _GemmFloor  # the benchmark's cuBLAS floor and peers

    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(n, d_s, **kw, requires_grad=True)
    xt = torch.randn(n, d_t, **kw)
    ws = (torch.randn(vocab, d_s, **kw) / d_s**0.5).requires_grad_()
    wt = torch.randn(vocab, d_t, **kw) / d_t**0.5

    def method(fn):
        forward = torch.no_grad()(lambda: fn(xs, xt, ws, wt, loss="forward_kl", reduction="none"))
        return forward, lambda: torch.autograd.grad(fn(xs, xt, ws, wt, loss="forward_kl", reduction="mean"), (xs, ws))

    others = {"cublas_gemms": (torch.no_grad()(lambda: _GemmFloor.apply(xs, xt, ws, wt)),
                               lambda: torch.autograd.grad(_GemmFloor.apply(xs, xt, ws, wt).mean(), (xs, ws)))}
    if peers:
        others["chunked_compile"] = method(METHODS["chunked_compile"])
    return (others, torch.no_grad()(lambda: nitrobrew.forward_kl(xs, xt, ws, wt, reduction="none")),
            lambda: torch.autograd.grad(nitrobrew.forward_kl(xs, xt, ws, wt), (xs, ws)))


def fused_linear_llama_problem(n: int, causal: bool, peers: bool):
    return fused_linear_problem(n, causal, peers, vocab=128256, d_s=2048, d_t=4096)


def topk_linear_problem(n: int, k: int, peers: bool, vocab=152064, d=3584):
    from topk_linear import gemm_run, teacher_topk  # the benchmark's cuBLAS floor and teacher

    torch.manual_seed(0)
    xs = torch.randn(n, d, device="cuda").to(torch.bfloat16).requires_grad_()
    ws = (torch.randn(vocab, d, device="cuda") * (3.0 / d**0.5)).to(torch.bfloat16).requires_grad_()
    ids, lps = teacher_topk(xs, ws, k)  # as the benchmark: the top-K of the student's logits plus noise
    others = {"cublas_gemms": (gemm_run(xs.detach(), ws.detach(), "forward"),
                               gemm_run(xs.detach(), ws.detach(), "fwd_bwd"))}
    return (others, torch.no_grad()(lambda: nitrobrew.topk_kl(xs, ws, ids, lps, reduction="none")),
            lambda: torch.autograd.grad(nitrobrew.topk_kl(xs, ws, ids, lps), (xs, ws)))


def logits_problem(n: int, loss: str, peers: bool, vocab=152064):
    torch.manual_seed(0)
    zs = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16).mul_(3).requires_grad_()
    zt = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16).mul_(3)
    if loss == "topk_kl":  # the teacher's top 128 of its logits
        with torch.no_grad():
            lps, ids = torch.log_softmax(zt.float(), -1).topk(128, dim=-1)
        ours = lambda **kw: nitrobrew.logits.topk_kl(zs, ids, lps, **kw)  # noqa: E731
    else:
        ours = lambda **kw: getattr(nitrobrew.logits, loss)(zs, zt, **kw)  # noqa: E731

    def torch_kl():  # PyTorch on the materialized float32 log-probabilities: forward KL
        log_p, log_q = torch.log_softmax(zs.float(), -1), torch.log_softmax(zt.float(), -1)
        return (log_q.exp() * (log_q - log_p)).sum(-1)

    others = {"torch_forward_kl": (torch.no_grad()(torch_kl), lambda: torch.autograd.grad(torch_kl().mean(), zs))}
    return (others, torch.no_grad()(lambda: ours(reduction="none")), lambda: torch.autograd.grad(ours(), zs))


# Each problem with the cases it runs (attention: causal or not; topk_linear: K; logits: the loss).
PROBLEMS = {"attention": (attention_problem, (False, True)), "fused_linear": (fused_linear_problem, (False,)),
            "fused_linear_llama": (fused_linear_llama_problem, (False,)),
            "topk_linear": (topk_linear_problem, (32, 128, 512)),
            "logits": (logits_problem, ("forward_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd", "topk_kl"))}


def apply(variant: str, names: set[str]) -> None:
    for name in names:
        os.environ.pop(name, None)
    if variant != "none":
        for setting in variant.split("+"):
            name, value = setting.split("=", 1)
            os.environ[name] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", choices=sorted(PROBLEMS))
    parser.add_argument("--variants", nargs="+", default=["none"])
    parser.add_argument("--n", default="8192")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--peers", action="store_true",
                        help="also time the peers (fused_linear: chunked_compile; attention: sdpa_flash)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    make, cases = PROBLEMS[args.problem]
    names = {s.split("=", 1)[0] for v in args.variants if v != "none" for s in v.split("+")}
    rows = []
    for n in [int(x) for x in args.n.split(",")]:
        for case in cases:
            others, ours_fwd, ours_step = make(n, case, args.peers)
            baseline = next(iter(others))
            checksums = {}
            for variant in args.variants:  # warm-up, and each variant's results (twice: run to run too)
                apply(variant, names)
                loss = float(ours_fwd().double().sum())
                grads = [float(sum(g.double().abs().sum() for g in ours_step())) for _ in range(2)]
                checksums[variant] = f"loss {loss!r} grads {grads[0]!r} {grads[1]!r}"
            for fwd, step in others.values():  # warm-up (and compile)
                fwd()
                step()
            times = {name: {"forward": [], "forward+backward": []} for name in [*others, *args.variants]}
            for r in range(args.rounds):
                for name, (fwd, step) in others.items():
                    times[name]["forward"].append(timed(fwd, args.iters))
                    times[name]["forward+backward"].append(timed(step, args.iters))
                # Each round starts with the next variant: the first one after the baseline ran
                # measurably slower (docs/notes/measurement.md), so no variant keeps that place.
                shift = r % len(args.variants)
                for variant in args.variants[shift:] + args.variants[:shift]:
                    apply(variant, names)
                    times[variant]["forward"].append(timed(ours_fwd, args.iters))
                    times[variant]["forward+backward"].append(timed(ours_step, args.iters))
            apply("none", names)
            for name, by_mode in times.items():
                for mode, rounds in by_mode.items():
                    ms = statistics.median(rounds)
                    row = dict(problem=args.problem, n=n, case=case, method=name, mode=mode,
                               median_ms=round(ms, 3), round_medians_ms=" ".join(f"{t:.3f}" for t in rounds),
                               ratio_to_baseline=round(ms / statistics.median(times[baseline][mode]), 3),
                               grad_checksum=checksums.get(name, ""))
                    rows.append(row)
                    print(row, flush=True)
            del others, ours_fwd, ours_step
            torch.cuda.empty_cache()
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
