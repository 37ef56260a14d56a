"""GPU time of each kernel of one forward + backward of a logit-level loss (torch.profiler), to
see where the time goes:

    python3 tools/profile_logits.py --loss jsd
    python3 tools/profile_logits.py --loss topk --k 512

Inputs: N x V bf16 logits (default 8192 x 152064, the benchmark's shape), seeded; for --loss topk
the teacher's top-K log-probabilities of its own logits.
"""

import argparse
import statistics
import time

import torch

import nitrobrew
import trace_gaps


def lone_call_times(step, zs, repeats=10):
    """Prints a step's time as the benchmark takes it (events around a lone call), behind a queued
    sleep kernel (the host's lead hidden), and the host's time per call, for forward + backward and
    for the forward alone (no grad)."""
    for mode in ("fwd_bwd", "forward"):
        lone, queued, host = [], [], []
        for behind_sleep in [False] * repeats + [True] * repeats:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if behind_sleep:
                torch.cuda._sleep(20_000_000)  # ~10 ms: longer than the host's work
            start.record()
            t0 = time.perf_counter()
            if mode == "forward":
                with torch.no_grad():
                    step(backward=False)
            else:
                step()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            torch.cuda.synchronize()
            (queued if behind_sleep else lone).append(start.elapsed_time(end))
        print(f"{mode}: lone call median {statistics.median(lone):.3f} ms (min {min(lone):.3f}); behind a queued "
              f"kernel {statistics.median(queued):.3f} ms; host time per call {statistics.median(host):.3f} ms")
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
