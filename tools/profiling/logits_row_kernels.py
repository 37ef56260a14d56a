"""One forward + backward of a logit-level loss on seeded logits, for ncu to profile the row kernels
(kl_pass_kernel, mixture_pass_kernel, grad_kernel) one at a time, e.g.

    ncu --section SourceCounters -k regex:mixture_pass -c 1 -o jsd_mix \\
        python3 tools/profiling/logits_row_kernels.py --loss jsd --dtype bfloat16
    ncu -i jsd_mix.ncu-rep --page source --csv --print-source sass > jsd_mix.csv

(tools/gpu/check.sh profile_logits runs the set; tools/profiling/ncu_source_summary.py reads the CSVs.)
The per-entry numbers do not depend on the row count, so the default is a quarter of the benchmark's rows.
"""

import argparse

import torch

import nitrobrew


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss", default="jsd")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152064)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    zs = (torch.randn(args.tokens, args.vocab, device="cuda", dtype=dtype) * 3).requires_grad_()
    zt = torch.randn(args.tokens, args.vocab, device="cuda", dtype=dtype) * 3
    loss = getattr(nitrobrew.logits, args.loss)(zs, zt)
    loss.backward()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
