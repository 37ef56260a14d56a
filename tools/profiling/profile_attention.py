"""Attention-KL forward and backward passes at one shape, for ncu (B = 1, bf16):

    ncu --kernel-name regex:fused_kernel --launch-skip 1 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats -o report \\
        python3 tools/profiling/profile_attention.py --n 8192
    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv
    python3 tools/profiling/ncu_source_summary.py source.csv

Runs two steps, so that --launch-skip 1 skips the first launch of each kernel.
"""

import argparse

import torch

import nitrobrew


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8192, help="N_q = N_k")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--kind", choices=["forward", "reverse"], default="forward")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    q_s, k_s, q_t, k_t = (torch.randn(1, args.n, args.heads, args.dim, device="cuda", dtype=torch.bfloat16)
                          for _ in range(4))
    q_s.requires_grad_()
    k_s.requires_grad_()
    for _ in range(2):
        with torch.set_grad_enabled(not args.forward_only):
            loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, kind=args.kind, causal=args.causal,
                                          deterministic=args.deterministic)
        if not args.forward_only:
            loss.backward()
    torch.cuda.synchronize()
    print(f"attention_kl N={args.n} H={args.heads} D={args.dim} causal={args.causal}: loss {float(loss):.6f}")


if __name__ == "__main__":
    main()
