"""A forward and a backward pass at one shape, for ncu:

    ncu --kernel-name regex:logit_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 tools/profile_fused_linear.py --tokens 2048

With --breakdown, prints the GPU time of each kernel of one forward + backward instead
(torch.profiler), to see where the time goes.
"""

import argparse

import torch

import nitrobrew


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--d-student", type=int, default=3584)
    parser.add_argument("--d-teacher", type=int, default=5120)
    parser.add_argument("--breakdown", action="store_true")
    args = parser.parse_args()
    kw = dict(device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(args.tokens, args.d_student, **kw, requires_grad=True)
    xt = torch.randn(args.tokens, args.d_teacher, **kw)
    ws = (torch.randn(args.vocab, args.d_student, **kw) / args.d_student**0.5).requires_grad_()
    wt = torch.randn(args.vocab, args.d_teacher, **kw) / args.d_teacher**0.5
    for _ in range(2):  # the first pass warms up; profile the second
        nitrobrew.forward_kl(xs, xt, ws, wt).backward()
    torch.cuda.synchronize()
    if args.breakdown:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            nitrobrew.forward_kl(xs, xt, ws, wt).backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()
