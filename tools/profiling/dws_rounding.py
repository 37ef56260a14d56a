"""How much accumulating dws in bf16 once per chunk of tokens costs (the training path on CUDA,
nitrobrew/_forward_grads.py), simulated on the CPU: G = (softmax(zs) - softmax(zt)) / N rounded to bf16,
dws = G^T . xs in float64 (exact), rounded to bf16 once (the recompute path), and accumulated in bf16 over
`chunks` chunks. Prints and writes the relative errors against the exact product.

    python tools/profiling/dws_rounding.py --out benchmarks/results/dws_chunk_rounding_cpu_<date>.csv
"""
from __future__ import annotations

import argparse
import csv
import datetime

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--rows", type=int, default=4608, help="tokens per chunk")
    p.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8])
    p.add_argument("--out")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for chunks in args.chunks:
        n = chunks * args.rows
        x = torch.randn(n, args.hidden).bfloat16().float()
        zs = torch.randn(n, args.vocab)
        zt = zs + 0.5 * torch.randn(n, args.vocab)  # a student near its teacher
        g = ((torch.softmax(zs, -1) - torch.softmax(zt, -1)) / n).bfloat16().float()
        exact = g.double().T @ x.double()
        once = (g.T @ x).bfloat16()
        acc = torch.zeros(args.vocab, args.hidden).bfloat16()
        for c in range(chunks):
            part = slice(c * args.rows, (c + 1) * args.rows)
            acc = (acc.float() + g[part].T @ x[part]).bfloat16()

        def rel(a):
            return ((a.double() - exact).norm() / exact.norm()).item()

        row = {"date": datetime.date.today().isoformat(), "device": "cpu", "torch": torch.__version__,
               "vocab": args.vocab, "hidden": args.hidden, "rows_per_chunk": args.rows, "chunks": chunks,
               "error_rounded_once": rel(once), "error_per_chunk": rel(acc), "ratio": rel(acc) / rel(once)}
        rows.append(row)
        print(f"chunks {chunks}: once {row['error_rounded_once']:.2e}  per chunk {row['error_per_chunk']:.2e}  "
              f"ratio {row['ratio']:.2f}")
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
