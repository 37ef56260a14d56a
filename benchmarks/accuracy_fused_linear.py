"""Accuracy of the fused-linear losses at a realistic shape, against a float64 oracle.

    python benchmarks/accuracy_fused_linear.py --tokens 2048 --loss forward_kl --paths recompute training

For bf16 inputs it reports, for each path (recompute: grad_in_forward=False; training: True, with
--grad-chunk-mib as its bound, so that dws is rounded once per chunk) and for the loss, dxs and dws, the
relative error
||x - oracle|| / ||oracle|| of nitrobrew and of a float32 PyTorch implementation (the inputs
widened to float32, logits materialized), that one also rounded to the gradients' dtype, and
the ratio nitrobrew / float32-PyTorch-rounded (the target: at most 2). CSV to --out.
"""

from __future__ import annotations

import argparse
import csv
import datetime

import torch

import nitrobrew
from nitrobrew import reference

BETAS = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}
PATHS = {"recompute": False, "training": True}  # grad_in_forward


def values_and_grads(fn, xs, xt, ws, wt, upstream, dtype):
    a = xs.detach().to(dtype).requires_grad_()
    b = ws.detach().to(dtype).requires_grad_()
    loss = fn(a, xt.to(dtype), b, wt.to(dtype))
    dxs, dws = torch.autograd.grad(loss, (a, b), upstream.to(loss.dtype))
    return [t.detach() for t in (loss, dxs, dws)]


def relative_error(x, oracle):
    return ((x.double() - oracle).norm() / oracle.norm()).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shape", default="152064,3584,5120", help="V,D_s,D_t")
    parser.add_argument("--loss", choices=list(BETAS), default="forward_kl")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--grad-chunk-mib", type=int, default=None, help="the training path's bound (default 2048)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    v, d_s, d_t = (int(x) for x in args.shape.split(","))
    dtype, beta, dev = getattr(torch, args.dtype), BETAS[args.loss], "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    xs = torch.randn(args.tokens, d_s, device=dev, generator=g).to(dtype)
    xt = torch.randn(args.tokens, d_t, device=dev, generator=g).to(dtype)
    ws = (torch.randn(v, d_s, device=dev, generator=g) * 4 / d_s**0.5).to(dtype)
    wt = (torch.randn(v, d_t, device=dev, generator=g) * 4 / d_t**0.5).to(dtype)
    upstream = torch.ones((), device=dev)
    kw = dict(beta=beta, temperature=args.temperature)

    def ref(xs, xt, ws, wt):
        return reference.fused_linear(xs, xt, ws, wt, dtype=None, **kw)

    oracle = values_and_grads(ref, xs, xt, ws, wt, upstream, torch.float64)
    torch.cuda.empty_cache()
    fp32 = values_and_grads(ref, xs, xt, ws, wt, upstream, torch.float32)
    torch.cuda.empty_cache()
    rows = []
    for path in args.paths:
        def fused(xs, xt, ws, wt, grad_in_forward=PATHS[path]):
            return nitrobrew.jsd(xs, xt, ws, wt, grad_in_forward=grad_in_forward, grad_chunk_mib=args.grad_chunk_mib,
                                 **kw)

        ours = values_and_grads(fused, xs, xt, ws, wt, upstream, dtype)
        for name, o, f, n in zip(("loss", "dxs", "dws"), oracle, fp32, ours):
            f_rounded = f if name == "loss" else f.to(dtype)
            row = {
                "path": path,
                "quantity": name,
                "nitrobrew": relative_error(n, o),
                "pytorch_fp32": relative_error(f, o),
                "pytorch_fp32_rounded": relative_error(f_rounded, o),
            }
            row["ratio"] = row["nitrobrew"] / max(row["pytorch_fp32_rounded"], 1e-30)
            rows.append(row)
        del ours
        torch.cuda.empty_cache()
    if dtype != torch.float32:
        # The loss from the logits of cuBLAS's bf16 tensor-core GEMM (fp32 output), reduced in
        # float64: how much of the loss error tensor-core accumulation alone explains.
        try:
            zs = torch.mm(xs, ws.T, out_dtype=torch.float32)
            zt = torch.mm(xt, wt.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError) as error:
            print(f"(no bf16 GEMM with float32 output in this torch: {error})")
        else:
            divergence = reference.divergence_from_logits(zs.double() / args.temperature,
                                                          zt.double() / args.temperature, beta)
            err = relative_error(divergence.mean(), oracle[0])
            rows.append({"path": "", "quantity": "loss_cublas_bf16_logits", "nitrobrew": float("nan"), "pytorch_fp32": err,
                         "pytorch_fp32_rounded": err, "ratio": float("nan")})
    meta = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(), torch=torch.__version__,
                loss=args.loss, dtype=args.dtype, N=args.tokens, V=v, Ds=d_s, Dt=d_t, temperature=args.temperature,
                grad_chunk_mib=args.grad_chunk_mib or "")
    print(", ".join(f"{k} {v}" for k, v in meta.items()))
    print(f"{'path':9s} {'quantity':9s} {'nitrobrew':>12s} {'fp32 torch':>12s} {'fp32 rounded':>13s} {'ratio':>7s}")
    for r in rows:
        print(f"{r['path']:9s} {r['quantity']:9s} {r['nitrobrew']:12.3e} {r['pytorch_fp32']:12.3e} {r['pytorch_fp32_rounded']:13.3e} "
              f"{r['ratio']:7.2f}")
    if args.out:
        with open(args.out, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(meta) + list(rows[0]))
            if f.tell() == 0:
                writer.writeheader()
            for r in rows:
                writer.writerow({**meta, **r})


if __name__ == "__main__":
    main()
