"""Clocks and power while steps run back to back: the cuBLAS products of the fused-linear floor,
then nitrobrew's forward KL forward + backward, each for --seconds, with nvidia-smi sampling the
SM clock, power and throttle reasons every 100 ms. Prints the time per step and the medians of
the samples taken during each phase (H100, N = 8192 by default).

    python3 tools/profiling/clock_probe.py --tokens 8192 [--out clocks.csv]

Why: the benchmark's back-to-back steps ran 8% slower than one step behind a queued sleep kernel
(docs/notes/measurement.md); if the fused kernels run at lower clocks than cuBLAS under sustained load,
that shows here.
"""

import argparse
import statistics
import subprocess
import time

import torch

import fused_linear_inputs
import nitrobrew

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def run_for(step, seconds):
    """Runs step back to back for about `seconds`; returns (steps, start, end) in host time."""
    step()
    torch.cuda.synchronize()
    start = time.time()
    steps = 0
    while time.time() - start < seconds:
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        steps += 4
    return steps, start, time.time()


def main():
    parser = argparse.ArgumentParser()
    fused_linear_inputs.add_shape_arguments(parser, tokens=8192)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", default=None, help="raw nvidia-smi samples as CSV")
    args = parser.parse_args()
    xs, xt, ws, wt = fused_linear_inputs.make_inputs(args)

    def cublas_step():  # the four products of the floor: two logit products, dxs and dws
        with torch.no_grad():
            zs = xs @ ws.T
            zt = xt @ wt.T
            zs @ ws
            zs.T @ xs
            del zt

    def nitrobrew_step():
        xs.grad = ws.grad = None
        nitrobrew.forward_kl(xs, xt, ws, wt).backward()

    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    phases = []
    for name, step in [("cublas_floor", cublas_step), ("nitrobrew_fwd_bwd", nitrobrew_step),
                       ("cublas_floor_again", cublas_step)]:
        steps, start, end = run_for(step, args.seconds)
        phases.append((name, steps, start, end))
        time.sleep(1.0)
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            stamp = time.mktime(time.strptime(fields[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + fields[0].split(".")[1]) if "." in fields[0] else 0.0
            samples.append((stamp, float(fields[1]), float(fields[2]), float(fields[3]), fields[4]))
        except (ValueError, IndexError):
            continue
    if args.out:
        with open(args.out, "w") as f:
            f.write(QUERY + "\n" + "\n".join(lines) + "\n")
    print(f"N={args.tokens} V={args.vocab} Ds={args.d_student} Dt={args.d_teacher} bf16, {torch.cuda.get_device_name()}")
    for name, steps, start, end in phases:
        inside = [s for s in samples if start + 0.5 <= s[0] <= end]  # skip the first half second
        ms = (end - start) * 1e3 / steps
        if not inside:
            print(f"{name}: {ms:.2f} ms/step over {steps} steps; no nvidia-smi samples")
            continue
        reasons = sorted({s[4] for s in inside})
        print(f"{name}: {ms:.2f} ms/step over {steps} steps; SM clock median "
              f"{statistics.median(s[1] for s in inside):.0f} MHz (min {min(s[1] for s in inside):.0f}), power median "
              f"{statistics.median(s[2] for s in inside):.0f} W, temperature max {max(s[3] for s in inside):.0f} C, "
              f"throttle reasons {reasons} ({len(inside)} samples)")


if __name__ == "__main__":
    main()
