"""A/B timing of two builds of nitrobrew (say, before and after a change), alternated process by
process: each round runs tools/experiments/ab_variants.py once per build (the builds' order rotating
from round to round), and each of those runs times the build's kernels beside the problem's
same-process baseline (the cuBLAS products, SDPA, a PyTorch loss from logits). The ratios to that
baseline are what is compared, so that clocks, temperature and the power cap weigh on both alike:

    python tools/experiments/ab_builds.py fused_linear --build before=/tmp/before --build after=. \
        --rounds 3 --out ab_builds.csv

A build is NAME=PATH, PATH a folder holding the nitrobrew package with its compiled extension (a
source checkout after `python setup.py build_ext --inplace`). An installed nitrobrew (pip install -e .
included) may shadow PYTHONPATH: uninstall it first; the paths printed first say which package each
build's runs import. The CSV has one
row per (build, round, case, mode) and the summary printed last the median ratio per build and the
after / before quotient.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build_env(path: str) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(path).resolve()), os.environ.get("PYTHONPATH", "")]))


def run_once(problem: str, path: str, args) -> list[dict]:
    """One ab_variants.py run of `problem` with the build at `path`: its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ab.csv"
        env = build_env(path)
        subprocess.run([sys.executable, str(HERE / "ab_variants.py"), problem, "--n", args.n, "--rounds",
                        str(args.inner_rounds), "--iters", str(args.iters), "--out", str(out)],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return [row for row in csv.DictReader(f)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("problem", help="a problem of ab_variants.py")
    parser.add_argument("--build", action="append", required=True, help="NAME=PATH (twice or more)")
    parser.add_argument("--n", default="8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inner-rounds", type=int, default=3, help="ab_variants.py's rounds per run")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    builds = [b.split("=", 1) for b in args.build]
    for name, path in builds:  # which package each build's processes import (from ab_variants.py's folder,
        # as its runs do: `python -c` would put the current folder, maybe a checkout, first on the path)
        where = subprocess.run([sys.executable, "-c", "import nitrobrew; print(nitrobrew.__file__)"], env=build_env(path),
                               cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
        print(f"{name}: {where}", flush=True)
    rows = []
    for r in range(args.rounds):
        shift = r % len(builds)
        for name, path in builds[shift:] + builds[:shift]:
            for row in run_once(args.problem, path, args):
                rows.append(dict(build=name, round=r, **row))
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{args.problem}: median ratio to the baseline over {args.rounds} rounds (ours / baseline)")
    first = builds[0][0]
    for case in dict.fromkeys(row["case"] for row in rows):
        for mode in ("forward", "forward+backward"):
            medians = {}
            for name, _ in builds:
                ratios = [float(row["ratio_to_baseline"]) for row in rows
                          if row["build"] == name and row["case"] == case and row["mode"] == mode
                          and row["method"] == "none"]
                medians[name] = statistics.median(ratios)
            quotients = " ".join(f"{name}/{first} {medians[name] / medians[first]:.3f}" for name, _ in builds[1:])
            listed = " ".join(f"{name} {m:.3f}" for name, m in medians.items())
            print(f"  case {case} {mode}: {listed}  {quotients}")


if __name__ == "__main__":
    main()
