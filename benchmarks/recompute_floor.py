"""How fast a recompute backward could be at best: cuBLAS's time for the six products of the
fused-linear losses' recompute design against the four of the compute floor, and naive PyTorch's
forward + backward, in one process -> CSV.

    python benchmarks/recompute_floor.py                    # H100: both shapes, N = 4096 / 8192 / 16384

A loss that never stores the [N x V] logits computes both logit matrices twice (forward, then the
recompute in the backward): xs.ws^T and xt.wt^T twice, then dxs = G.ws and dws = G^T.xs. The floor
counts each product once, as naive PyTorch (which keeps the logits) does them. Here cuBLAS runs
exactly those products (bf16 in and out, as benchmarks/fused_linear.py's floor), back to back:
  four    xs.ws^T, xt.wt^T, G.ws, G^T.xs (the floor)
  six     the same with xs.ws^T and xt.wt^T twice (the recompute design at cuBLAS's speed)
  naive   benchmarks/fused_linear.py's naive PyTorch forward KL, forward + backward
Methods alternate within each round (their order rotating); medians over rounds of each round's
median of --iters calls.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fused_linear import METHODS  # noqa: E402
from harness import device_name, time_runs, write_csv  # noqa: E402

SHAPES = {"qwen": (152064, 3584, 5120), "llama3": (128256, 2048, 4096)}


def methods(n, vocab, d_s, d_t):
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    xs, xt = torch.randn(n, d_s, **kw), torch.randn(n, d_t, **kw)
    ws, wt = torch.randn(vocab, d_s, **kw) / d_s**0.5, torch.randn(vocab, d_t, **kw) / d_t**0.5
    g = torch.randn(n, vocab, **kw) / n  # stands in for dLoss/dz

    def products(logit_passes):
        def run():
            for _ in range(logit_passes):
                xs @ ws.T
                xt @ wt.T
            g @ ws
            g.T @ xs
        return run

    xs_g, ws_g = xs.clone().requires_grad_(), ws.clone().requires_grad_()

    def naive():
        loss = METHODS["naive"](xs_g, xt, ws_g, wt, loss="forward_kl", reduction="mean")
        torch.autograd.grad(loss, (xs_g, ws_g))

    return {"four": products(1), "six": products(2), "naive": naive}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen", "llama3"])
    p.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    rows = []
    common = dict(date=datetime.date.today().isoformat(), device=device_name(torch.device("cuda")),
                  torch=torch.__version__, cuda=torch.version.cuda)
    for shape in args.shapes:
        vocab, d_s, d_t = SHAPES[shape]
        for n in args.n:
            runs = methods(n, vocab, d_s, d_t)
            for fn in runs.values():  # warm-up
                fn()
            times = {name: [] for name in runs}
            names = list(runs)
            for r in range(args.rounds):
                shift = r % len(names)
                for name in names[shift:] + names[:shift]:
                    times[name].append(statistics.median(time_runs(runs[name], torch.device("cuda"), 0, args.iters)))
            floor = statistics.median(times["four"])
            for name, rounds in times.items():
                ms = statistics.median(rounds)
                row = dict(common, shape=shape, n=n, method=name, median_ms=round(ms, 3),
                           round_medians_ms=" ".join(f"{t:.3f}" for t in rounds), ratio_to_four=round(ms / floor, 3))
                rows.append(row)
                print(row, flush=True)
            del runs
            torch.cuda.empty_cache()
    write_csv(args.out, list(rows[0]), rows)


if __name__ == "__main__":
    main()
