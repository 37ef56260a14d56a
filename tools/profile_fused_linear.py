"""A forward and a backward pass at one shape, for ncu:

    ncu --kernel-name regex:logit_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 tools/profile_fused_linear.py --tokens 2048

With --breakdown, prints the GPU time of each kernel of one forward + backward instead
(torch.profiler), to see where the time goes. --forward-only leaves out the backward;
--repeats R also prints the median wall time of R runs and a checksum of the loss and the
gradients (the inputs are seeded, so runs of kernel variants, which must not change the results,
can be compared; tools/bench_experiments.sh does).
"""

import argparse
import os
import statistics

import torch

import nitrobrew


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--d-student", type=int, default=3584)
    parser.add_argument("--d-teacher", type=int, default=5120)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16)
    xs = torch.randn(args.tokens, args.d_student, **kw, requires_grad=True)
    xt = torch.randn(args.tokens, args.d_teacher, **kw)
    ws = (torch.randn(args.vocab, args.d_student, **kw) / args.d_student**0.5).requires_grad_()
    wt = torch.randn(args.vocab, args.d_teacher, **kw) / args.d_teacher**0.5
    mode = "forward" if args.forward_only else "forward + backward"

    def step():
        loss = nitrobrew.forward_kl(xs, xt, ws, wt)
        if not args.forward_only:
            loss.backward()
        return loss

    for _ in range(2):  # the first pass warms up; profile the second
        step()
    torch.cuda.synchronize()
    if args.repeats > 0:
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        print(f"N={args.tokens} V={args.vocab} Ds={args.d_student} Dt={args.d_teacher} bf16, {mode}, "
              f"NITROBREW_FORCE_SM80='{os.environ.get('NITROBREW_FORCE_SM80', '')}': "
              f"median {statistics.median(times):.2f} ms, min {min(times):.2f} ms of {args.repeats}")
        xs.grad = ws.grad = None  # the gradients of one step, not of all steps so far
        loss = step()
        check = f"check: loss {loss.item():.9e}"
        if not args.forward_only:
            check += f", |dxs| {xs.grad.float().norm().item():.9e}, |dws| {ws.grad.float().norm().item():.9e}"
        print(check)
    if args.breakdown:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"kernels of one {mode}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()
