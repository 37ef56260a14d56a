"""Summarizes ncu's per-instruction source view of one kernel (the CSV of
`ncu -i REPORT --page source --csv --print-source sass`, plain or gzipped): the share of executed
instructions and of warp samples per opcode, the stall reasons over all samples, and the
instructions with the most samples, e.g.

    python3 tools/profiling/ncu_source_summary.py source.csv --top 15
"""

import argparse
import collections
import csv
import gzip
import re


def read_rows(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.reader(f))
    # The export starts with a "Kernel Name" line, then the header.
    start = next(i for i, row in enumerate(rows) if "Source" in row and "# Samples" in row)
    header = rows[start]
    return [dict(zip(header, row)) for row in rows[start + 1:] if len(row) == len(header)], header


def number(text):
    return int(text.replace(",", "")) if text and text.replace(",", "").isdigit() else 0


def summarize(rows, header, top):
    stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = sum(number(r["# Samples"]) for r in rows) or 1
    executed = sum(number(r["Instructions Executed"]) for r in rows) or 1
    by_op_executed, by_op_samples, by_stall = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        match = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)", r["Source"].strip())
        op = match.group(2) if match else "?"
        by_op_executed[op] += number(r["Instructions Executed"])
        by_op_samples[op] += number(r["# Samples"])
        for s in stalls:
            by_stall[s[len("stall_"):]] += number(r[s])
    lines = [f"{executed / 1e9:.2f} G warp instructions executed, {samples} samples",
             "opcode        % instructions  % samples"]
    for op, n in by_op_executed.most_common(top):
        lines.append(f"{op:12s} {100 * n / executed:8.1f}      {100 * by_op_samples[op] / samples:8.1f}")
    lines.append("stall reasons (% of samples): " +
                 ", ".join(f"{s} {100 * n / samples:.1f}" for s, n in by_stall.most_common(8)))
    lines.append("instructions with the most samples (main stall reason):")
    ranked = sorted(rows, key=lambda r: number(r["# Samples"]), reverse=True)[:top]
    for r in ranked:
        reason = max(stalls, key=lambda s: number(r[s]))[len("stall_"):] if stalls else "?"
        lines.append(f"{100 * number(r['# Samples']) / samples:5.1f}%  {r['Source'].strip()[:60]:60s} ({reason})")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    rows, header = read_rows(args.csv)
    print(summarize(rows, header, args.top))


if __name__ == "__main__":
    main()
