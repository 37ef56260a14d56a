"""A forward and a backward pass at one shape, for ncu:

    ncu --kernel-name regex:logit_kernel --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 tools/profiling/profile_fused_linear.py --tokens 2048

With --breakdown, prints the GPU time of each kernel of one forward + backward instead
(torch.profiler), to see where the time goes. With --topk K the step is nitrobrew.topk_kl
(normalize="full") on the student's shape against the top-K of its own logits plus noise, as
benchmarks/topk_linear.py's. --forward-only leaves out the backward;
--repeats R also prints the median wall time of R runs and a checksum of the loss and the
gradients (the inputs are seeded, so runs of kernel variants, which must not change the results,
can be compared; tools/experiments/bench_experiments.sh does).
"""

import argparse
import os
import sys
from pathlib import Path

import torch

import fused_linear_inputs
import nitrobrew
import step_timing
import trace_gaps

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from topk_linear import teacher_topk  # noqa: E402  (the top-K benchmark's teacher)


def main():
    parser = argparse.ArgumentParser()
    fused_linear_inputs.add_shape_arguments(parser, tokens=2048)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--topk", type=int, default=0, help="K: profile nitrobrew.topk_kl instead")
    args = parser.parse_args()
    xs, xt, ws, wt = fused_linear_inputs.make_inputs(args)
    mode = "forward" if args.forward_only else "forward + backward"
    if args.topk:
        ids, lps = teacher_topk(xs, ws, args.topk)

    def step():
        if args.topk:
            loss = nitrobrew.topk_kl(xs, ws, ids, lps)
        else:
            loss = nitrobrew.forward_kl(xs, xt, ws, wt)
        if not args.forward_only:
            loss.backward()
        return loss

    for _ in range(2):  # the first pass warms up; profile the second
        xs.grad = ws.grad = None  # as after zero_grad(): no gradient-accumulation kernels
        step()
    torch.cuda.synchronize()
    if args.repeats > 0:
        # Each step timed twice over: as issued (the GPU waits while the host prepares the first
        # launch) and behind a queued sleep kernel (the host's lead hidden; but the GPU also rests
        # during the sleep, and such steps ran 8% faster at N = 8192: docs/notes/measurement.md).
        def fresh_gradients():
            xs.grad = ws.grad = None  # as after zero_grad()

        median, fastest, primed, host = step_timing.lone_and_queued(step, args.repeats, 200_000_000,  # ~0.1 s
                                                                    reset=fresh_gradients)
        print(f"N={args.tokens} V={args.vocab} Ds={args.d_student} Dt={args.d_teacher} bf16, {mode}, "
              f"NITROBREW_FORCE_SM80='{os.environ.get('NITROBREW_FORCE_SM80', '')}': "
              f"median {median:.2f} ms, min {fastest:.2f} ms of {args.repeats}; "
              f"behind a queued kernel {primed:.2f} ms; host time per step {host:.2f} ms")
        xs.grad = ws.grad = None  # the gradients of one step, not of all steps so far
        loss = step()
        check = f"check: loss {loss.item():.9e}"
        if not args.forward_only:
            check += f", |dxs| {xs.grad.float().norm().item():.9e}, |dws| {ws.grad.float().norm().item():.9e}"
        print(check)
    if args.breakdown:
        xs.grad = ws.grad = None  # as a training step after zero_grad(): no accumulation kernels
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(f"kernels of one {mode}:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
        trace_gaps.print_gaps(prof)


if __name__ == "__main__":
    main()
