"""Where the Hopper attention-KL forward's tile step goes, from the kernel's own clock stamps
(NITROBREW_FWD_TIMELINE of a development build, NITROBREW_DEV_KNOBS=1;
csrc/attention_kl/attention_kl_fwd_sm90.cu): per consumer warpgroup and key tile,
the cycles spent waiting for the stage, waiting for its turn, issuing, waiting for the products
and folding; the producer's wait for a free stage; and how much of one warpgroup's fold overlaps
the other's products (the ping-pong's purpose).

    python3 tools/profiling/fwd_timeline.py --n 8192 [--causal] [--out timeline.csv]

bfloat16, forward KL, B = 1, H = 32, D = 128. Medians over every block and every key tile past the
first two (the ring's fill) and before the last.
"""

import argparse
import csv
import os
import statistics
import sys
import tempfile

import numpy as np
import torch

import nitrobrew

NAMES = ["wait_full", "got_full", "got_turn", "issued", "products_done", "folded"]


def stamps_of(n: int, causal: bool, heads: int, dim: int) -> np.ndarray:
    """[blocks, tiles, 13] clock stamps of one forward (0 where a block has fewer tiles)."""
    torch.manual_seed(0)
    q_s, k_s, q_t, k_t = (torch.randn(1, n, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=causal)  # warm-up, plain kernel
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "stamps.bin")
        os.environ["NITROBREW_FWD_TIMELINE"] = path
        try:
            nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=causal)
            torch.cuda.synchronize()
        finally:
            del os.environ["NITROBREW_FWD_TIMELINE"]
        raw = np.fromfile(path, dtype=np.int64)
    blocks, tiles, stamps = (int(x) for x in raw[:3])
    return raw[3:].reshape(blocks, tiles, stamps)


def overlap(a0, a1, b0, b1):
    """Length of the intersection of intervals [a0, a1] and [b0, b1] (elementwise)."""
    return np.clip(np.minimum(a1, b1) - np.maximum(a0, b0), 0, None)


def summarize(st: np.ndarray) -> dict:
    per = len(NAMES)
    consumers = (st.shape[2] - 1) // per
    wg = [st[:, :, c * per:(c + 1) * per] for c in range(consumers)]
    producer = st[:, :, consumers * per]
    valid = (wg[0][:, :, 0] > 0) & (wg[-1][:, :, 5] > 0)
    # Steady tiles: from the third to the one before each block's last.
    counts = valid.sum(axis=1)
    idx = np.arange(st.shape[1])[None, :]
    steady = valid & (idx >= 2) & (idx < counts[:, None] - 1)
    out = {"consumers": consumers, "blocks": st.shape[0], "tiles_per_block_median": float(np.median(counts))}
    for c in range(consumers):
        x = wg[c]
        parts = {
            "stage_wait": x[:, :, 1] - x[:, :, 0],
            "turn_wait": x[:, :, 2] - x[:, :, 1],
            "issue": x[:, :, 3] - x[:, :, 2],
            "products_wait": x[:, :, 4] - x[:, :, 3],
            "fold": x[:, :, 5] - x[:, :, 4],
        }
        nxt = np.roll(x[:, :, 0], -1, axis=1)
        parts["period"] = nxt - x[:, :, 0]
        for name, v in parts.items():
            out[f"wg{c}_{name}"] = float(np.median(v[steady]))
            out[f"wg{c}_{name}_mean"] = float(np.mean(v[steady]))
    # The producer's stamp is taken when a stage is free for tile j; the consumers get it at got_full.
    load = np.min([w[:, :, 1] for w in wg], axis=0) - producer
    out["load_to_first_consumer"] = float(np.median(load[steady]))
    # How much of warpgroup c's fold runs while another's products are in flight (from its turn, as
    # issuing waits for the tensor cores, to their end), of the same tile or the next.
    for c in range(consumers):
        fold0, fold1 = wg[c][:, :, 4], wg[c][:, :, 5]
        covered = np.zeros_like(fold0)
        for o in range(consumers):
            if o == c:
                continue
            for shift in (0, -1):
                start, end = (np.roll(wg[o][:, :, k], shift, axis=1) for k in (2, 4))
                covered = covered + overlap(fold0, fold1, start, end)
        frac = covered / np.maximum(fold1 - fold0, 1)
        out[f"wg{c}_fold_overlapped_by_other_products"] = float(np.median(frac[steady]))
    return out


def print_tiles(st: np.ndarray):
    """One block's stamps per tile, in cycles from its first: when each warpgroup reached each
    point, and when the producer found the tile's stage free."""
    t0 = st[st > 0].min()
    consumers = (st.shape[1] - 1) // len(NAMES)
    names = [f"wg{c}_{n}" for c in range(consumers) for n in NAMES] + ["producer_free"]
    print("tile " + " ".join(f"{n[:17]:>17s}" for n in names))
    for j, row in enumerate(st):
        print(f"{j:4d} " + " ".join(f"{int(v - t0) if v else -1:17d}" for v in row))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", help="CSV to append the summary to")
    parser.add_argument("--dump", type=int, default=0, help="print the stamps of this many tiles of block 0")
    args = parser.parse_args()
    stamps = stamps_of(args.n, args.causal, args.heads, args.dim)
    if args.dump:
        print_tiles(stamps[0, :args.dump])
    summary = {"n": args.n, "causal": args.causal, **summarize(stamps)}
    for k, v in summary.items():
        print(f"{k:40s} {v:.1f}" if isinstance(v, float) else f"{k:40s} {v}")
    if args.out:
        new = not os.path.exists(args.out)
        with open(args.out, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(summary))
            if new:
                w.writeheader()
            w.writerow(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
