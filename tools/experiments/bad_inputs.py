"""Tries the bad inputs of issue 27 on every family and device, as a new user would, and prints what
each gets: the exception (type and message) or the loss. After every call on CUDA a good call must
still run (no device-side assertion poisoned the context).

    python tools/experiments/bad_inputs.py [--device cpu|cuda] > bad_inputs.md
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import nitrobrew

NAN, INF = float("nan"), float("inf")


def outcome(fn):
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the point is to show what the user gets
        return f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
    if isinstance(out, torch.Tensor):
        values = out.detach().float().cpu().flatten().tolist()
        shown = ", ".join(f"{v:.4g}" for v in values[:6]) + (" ..." if len(values) > 6 else "")
        return f"ok: [{shown}]"
    return f"ok: {out!r}"


def cases(device):
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    n, v, d, k = 4, 50, 16, 5
    xs, xt = torch.randn(n, d, generator=g), torch.randn(n, d + 8, generator=g)
    ws, wt = torch.randn(v, d, generator=g), torch.randn(v, d + 8, generator=g)
    xs, xt, ws, wt = (t.to(device, dt) for t in (xs, xt, ws, wt))
    zs, zt = (torch.randn(n, v, generator=g) * 2).to(device), (torch.randn(n, v, generator=g) * 2).to(device)
    lps, ids = torch.log_softmax(zt.float(), -1).topk(k, dim=-1)
    labels = torch.arange(n, device=device)

    def with_row(t, row, value, col=None):
        t = t.clone()
        if col is None:
            t[row] = value
        else:
            t[row, col] = value
        return t

    bad_ids = with_row(ids, 1, v + 3, 2)
    neg_ids = with_row(ids, 2, -1, 0)
    yield "top-K id >= V (logits)", lambda: nitrobrew.logits.topk_kl(zs, bad_ids, lps)
    yield "top-K id < 0 (hidden states)", lambda: nitrobrew.topk_kl(xs, ws, neg_ids, lps)
    compiled = torch.compile(lambda a, b, c: nitrobrew.logits.topk_kl(a, b, c, reduction="none"))
    yield "top-K id >= V under torch.compile (logits)", lambda: compiled(zs, bad_ids, lps)
    yield "CE label >= V with ce_weight", lambda: nitrobrew.forward_kl(
        xs, xt, ws, wt, labels=with_row(labels, 1, v), ce_weight=0.5)
    for name, value in [("NaN", NAN), ("+inf", INF), ("-inf", -INF)]:
        yield f"teacher log-probs row all {name} (logits, full)", lambda value=value: nitrobrew.logits.topk_kl(
            zs, ids, with_row(lps, 1, value), reduction="none")
        yield f"teacher log-probs row all {name} (logits, topk)", lambda value=value: nitrobrew.logits.topk_kl(
            zs, ids, with_row(lps, 1, value), normalize="topk", reduction="none")
        yield f"teacher log-probs row all {name} (hidden, full)", lambda value=value: nitrobrew.topk_kl(
            xs, ws, ids, with_row(lps, 1, value), reduction="none")
        yield f"one {name} teacher logit (logits forward_kl)", lambda value=value: nitrobrew.logits.forward_kl(
            zs, with_row(zt, 1, value, 3), reduction="none")
        yield f"student logit row all {name} (logits jsd)", lambda value=value: nitrobrew.logits.jsd(
            with_row(zs, 1, value), zt, reduction="none")
    yield "one NaN in xs (forward_kl)", lambda: nitrobrew.forward_kl(
        with_row(xs, 1, NAN, 0), xt, ws, wt, reduction="none")
    yield "NaN row masked by ignore_index (logits reverse_kl)", lambda: nitrobrew.logits.reverse_kl(
        with_row(zs, 1, NAN), zt, labels=with_row(labels, 1, -100))
    b, nq, h, hd = 2, 6, 2, 8
    q = torch.randn(b, nq, h, hd, generator=g).to(device)
    kk = torch.randn(b, nq, h, hd, generator=g).to(device)
    mask = torch.ones(b, nq, dtype=torch.int64, device=device)
    mask[0, 4:] = 0
    yield "attention_kl float32", lambda: nitrobrew.attention_kl(q, kk, q, kk * 1.1, causal=True)
    yield "attention_kl int64 attention_mask", lambda: nitrobrew.attention_kl(
        q.to(dt), kk.to(dt), q.to(dt), (kk * 1.1).to(dt), attention_mask=mask)
    yield "attention_kl layout='bhnd'", lambda: nitrobrew.attention_kl(
        *(t.transpose(1, 2) for t in (q, kk, q, kk * 1.1)), layout="bhnd")
    yield "attention_kl query_mask", lambda: nitrobrew.attention_kl(q, kk, q, kk * 1.1, query_mask=mask)
    yield "D = 0", lambda: nitrobrew.forward_kl(xs[:, :0], xt, ws[:, :0], wt)
    yield "ws with 0 rows", lambda: nitrobrew.forward_kl(xs, xt, ws[:0], wt[:0])
    yield "temperature as a 0-d tensor", lambda: nitrobrew.forward_kl(xs, xt, ws, wt, temperature=torch.tensor(2.0))
    yield "ignore_index as numpy int", lambda: nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels,
                                                                   ignore_index=np.int64(-100))
    yield "meta tensors", lambda: nitrobrew.forward_kl(*(t.to("meta") for t in (xs, xt, ws, wt))).shape
    yield "temperature = 0", lambda: nitrobrew.forward_kl(xs, xt, ws, wt, temperature=0)
    yield "labels of the wrong shape", lambda: nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels[:2])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    good = lambda: nitrobrew.forward_kl(*(torch.randn(3, 8, device=device) for _ in range(2)),  # noqa: E731
                                        *(torch.randn(20, 8, device=device) for _ in range(2)))
    print(f"| bad input ({device}) | what it gets |\n|---|---|")
    for name, fn in cases(device):
        result = outcome(fn)
        if device == "cuda":
            after = outcome(lambda: (good(), torch.cuda.synchronize())[0])
            if not after.startswith("ok"):
                result += f" -- AND THE NEXT GOOD CALL FAILED: {after}"
        print(f"| {name} | {result.replace('|', '/')} |", flush=True)


if __name__ == "__main__":
    main()
