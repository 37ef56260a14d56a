"""What the range checks of ids and labels cost per call (docs/design.md, "Ids and labels in range").

In eager mode the Python functions read one flag on the host before the op runs (on CUDA a
synchronization); the CUDA ops also guard the ids on the device (guard_topk_ids: a few elementwise
kernels over [N, K]). This times each loss forward and forward + backward with the host check on
and off (off: as under torch.compile), alternated over several rounds in one process, and the device
guard's elementwise work alone.

    python benchmarks/input_checks.py --device cuda --out input_checks.csv
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys

import torch

import harness
import nitrobrew
from nitrobrew import _checks


def problems(device, n, v, d, k):
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16
    xs = (torch.randn(n, d, generator=g) * 0.5).to(device, dtype)
    xt = (torch.randn(n, d, generator=g) * 0.5).to(device, dtype)
    ws = (torch.randn(v, d, generator=g) * d**-0.5).to(device, dtype)
    wt = (torch.randn(v, d, generator=g) * d**-0.5).to(device, dtype)
    ids = torch.randint(0, v, (n, k), generator=g).to(device)
    lps = torch.randn(n, k, generator=g).log_softmax(-1).to(device)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    zs = xs @ ws.T
    return {
        "topk_kl (logits)": (lambda: nitrobrew.logits.topk_kl(zs, ids, lps), zs),
        "topk_kl (hidden states)": (lambda: nitrobrew.topk_kl(xs, ws, ids, lps), xs),
        "forward_kl + ce labels": (lambda: nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, ce_weight=0.1), xs),
    }, (ids, lps, v)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--v", type=int, default=152064)
    parser.add_argument("--d", type=int, default=3584)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cases, (ids, lps, v) = problems(device, args.n, args.v, args.d, args.k)
    checked = _checks.host_checks_possible
    rows = []
    for name, (call, grad_input) in cases.items():
        for mode in ("forward", "forward+backward"):
            def run():
                if mode == "forward":
                    with torch.no_grad():
                        call()
                else:
                    grad_input.requires_grad_(True)
                    call().backward()
                    grad_input.grad = None
                    grad_input.requires_grad_(False)
            times = {"host check": [], "no host check": []}
            for _ in range(args.rounds):  # alternated, so that clock drift hits both alike
                for label in times:
                    _checks.host_checks_possible = checked if label == "host check" else (lambda t: False)
                    times[label] += harness.time_runs(run, device, warmup=2, repeats=args.repeats)
            _checks.host_checks_possible = checked
            on, off = (statistics.median(times[label]) for label in ("host check", "no host check"))
            rows.append({"loss": name, "pass": mode, "ms_with_host_check": round(on, 4),
                         "ms_without": round(off, 4), "cost_us": round((on - off) * 1e3, 1),
                         "cost_pct": round(100 * (on - off) / off, 2)})
            print(rows[-1], flush=True)
    # The device guard alone: what guard_topk_ids launches, on the same [N, K] teacher.
    def guard():
        outside = (ids < 0).logical_or_(ids >= v)
        ids.masked_fill(outside, 0)
        lps.masked_fill(outside, float("nan"))
    guard_ms = statistics.median(harness.time_runs(guard, device, warmup=3, repeats=args.rounds * args.repeats))
    rows.append({"loss": "guard_topk_ids alone", "pass": "forward", "ms_with_host_check": round(guard_ms, 4),
                 "ms_without": "", "cost_us": round(guard_ms * 1e3, 1), "cost_pct": ""})
    print(rows[-1], flush=True)
    meta = {"device": harness.device_name(device), "torch": torch.__version__}
    if args.out:
        with open(args.out, "w", newline="") as f:
            for key, value in meta.items():
                f.write(f"# {key}: {value}\n")
            f.write(f"# shapes: N={args.n} V={args.v} D={args.d} K={args.k} bf16; median of {args.rounds} "
                    f"alternated rounds x {args.repeats} runs\n")
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
