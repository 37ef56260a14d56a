"""GPU time of each kernel of one forward + backward of a logit-level loss (torch.profiler), to
see where the time goes:

    python3 tools/profiling/profile_logits.py --loss jsd
    python3 tools/profiling/profile_logits.py --loss topk --k 512

Inputs: N x V bf16 logits (default 8192 x 152064, the benchmark's shape), seeded; for --loss topk
the teacher's top-K log-probabilities of its own logits.
"""

import argparse

import torch

import nitrobrew
import step_timing
import trace_gaps


def lone_call_times(step, zs, repeats=10):
    """Prints a step's time as the benchmark takes it (events around a lone call), behind a queued
    sleep kernel (the host's lead hidden), and the host's time per call, for forward + backward and
    for the forward alone (no grad)."""
    def forward():
        with torch.no_grad():
            step(backward=False)

    for mode, fn in (("fwd_bwd", step), ("forward", forward)):
        lone, lone_min, queued, host = step_timing.lone_and_queued(fn, repeats, 20_000_000)  # ~10 ms sleep
        print(f"{mode}: lone call median {lone:.3f} ms (min {lone_min:.3f}); behind a queued "
              f"kernel {queued:.3f} ms; host time per call {host:.3f} ms")
    zs.grad = None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss", choices=["forward_kl", "reverse_kl", "jsd", "topk"], default="jsd")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--k", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    zs = torch.randn(args.tokens, args.vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    zt = torch.randn(args.tokens, args.vocab, device="cuda", dtype=torch.bfloat16)
    if args.loss == "topk":
        logprobs, ids = torch.log_softmax(zt.float(), -1).topk(args.k, -1)
        del zt

        def step(backward=True):
            zs.grad = None
            loss = nitrobrew.logits.topk_kl(zs, ids, logprobs)
            if backward:
                loss.backward()
    else:
        def step(backward=True):
            zs.grad = None
            loss = getattr(nitrobrew.logits, args.loss)(zs, zt)
            if backward:
                loss.backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    lone_call_times(step, zs)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("step"):
            step()
        torch.cuda.synchronize()
    print(f"kernels of one forward + backward, {args.loss}, K={args.k}, {args.tokens} x {args.vocab} bf16:")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=70))
    trace_gaps.print_gaps(prof, timeline=True)


if __name__ == "__main__":
    main()
