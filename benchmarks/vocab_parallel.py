"""The vocabulary-parallel loss on several GPUs (NCCL, one process a GPU): forward and forward + backward
of forward KL with the vocabulary split over R GPUs, the same tokens on every rank (tensor parallelism),
against two ways to do the same job:

  allgather_weights  all-gather both lm_head shards, run the single-GPU nitrobrew loss, keep the
                     student's rows of dws (what FSDP-style gathering of the weights costs);
  megatron_logits    each rank's [N, V/R] logits in float32 and a vocabulary-parallel forward KL
                     through autograd-aware all-reduces (Megatron's vocab-parallel cross-entropy way),
                     the input's gradient all-reduced in the backward;
  nitrobrew          nitrobrew.forward_kl(..., process_group=): per-token statistics only (the automatic path
                     choice: fwd + bwd on the training path where it runs);
  nitrobrew_recompute  the same on the recompute path (grad_in_forward=False);
  local_shard        the single-GPU loss on this rank's rows alone, no communication (not the whole
                     vocabulary's loss): the compute floor of R GPUs, so that nitrobrew's distance from
                     perfect scaling splits into the kernels' at V/R rows and the communication's.

Per method and mode: time (rank 0's CUDA events, each round measured between barriers, the methods
alternating round by round; the median of the rounds' medians), peak memory above the inputs on rank
0, the bytes each rank sends per step (counted from the collectives' tensors with ring formulas), and
for nitrobrew and local_shard the scaling efficiency against R = 1 (the whole vocabulary on one GPU):
t_1 / (R * t_R).

    torchrun-free:  python benchmarks/vocab_parallel.py --gpus 1 2 4 --out benchmarks/results/...csv

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are set before any process starts).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import harness  # noqa: E402

METHODS = ("nitrobrew", "nitrobrew_recompute", "local_shard", "allgather_weights", "megatron_logits")
COLUMNS = ["date", "device", "gpus", "torch", "method", "mode", "N", "V", "Ds", "Dt", "status", "median_ms",
           "min_ms", "peak_extra_mib", "sent_mib_per_rank", "scaling_efficiency", "loss_value", "round_medians_ms"]


class ByteCounter:
    """Bytes this rank sends, from the collectives it calls (ring algorithms: an all-gather or a
    reduce-scatter sends (R - 1)/R of the whole buffer, an all-reduce twice that)."""

    def __init__(self, world):
        self.world, self.sent = world, 0
        self._originals = {}

    def __enter__(self):
        share = (self.world - 1) / self.world

        def wrap(name, factor, size_of):
            original = getattr(dist, name)

            def counted(*args, **kwargs):
                self.sent += factor * share * size_of(*args)
                return original(*args, **kwargs)

            self._originals[name] = original
            setattr(dist, name, counted)

        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                wrap(name, 1, lambda out, inp, *a: nbytes(out))
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):
                wrap(name, 1, lambda out, inp, *a: nbytes(inp))
        wrap("all_reduce", 2, lambda t, *a: nbytes(t))
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


def megatron_forward_kl(xs, xt, ws, wt):
    """Forward KL over vocabulary-parallel float32 logits, as Megatron's vocab-parallel loss computes."""
    from torch.distributed.nn.functional import all_reduce

    xs = _CopyToTensorParallel.apply(xs)
    zs = (xs @ ws.T).float()
    with torch.no_grad():
        zt = (xt @ wt.T).float()
        t_max = zt.amax(-1, keepdim=True)
        dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
        t_sum = (zt - t_max).exp().sum(-1, keepdim=True)
        dist.all_reduce(t_sum)
        log_q = zt - t_max - t_sum.log()
        q = log_q.exp()
        s_max = zs.detach().amax(-1, keepdim=True)
        dist.all_reduce(s_max, op=dist.ReduceOp.MAX)
    s_sum = all_reduce((zs - s_max).exp().sum(-1, keepdim=True))
    log_p = zs - s_max - s_sum.log()
    return all_reduce((q * (log_q - log_p)).sum(-1)).mean()


def run_method(method, xs, xt, ws, wt, world):
    if method in ("nitrobrew", "nitrobrew_recompute"):  # the automatic path choice, or the recompute path
        path = {"grad_in_forward": False} if method == "nitrobrew_recompute" else {}
        if world == 1:
            return nitrobrew.forward_kl(xs, xt, ws, wt, **path)
        return nitrobrew.forward_kl(xs, xt, ws, wt, process_group=dist.group.WORLD, **path)
    if method == "local_shard":
        return nitrobrew.forward_kl(xs, xt, ws, wt)
    if method == "allgather_weights":
        whole = [torch.empty((ws.shape[0] * world, w.shape[1]), dtype=w.dtype, device=w.device) for w in (ws, wt)]
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name since torch 2.13
        gather(whole[0], ws.detach())
        gather(whole[1], wt.detach())
        ws_whole = _RowsOfWhole.apply(ws, whole[0], dist.get_rank())
        return nitrobrew.forward_kl(xs, xt, ws_whole, whole[1])
    return megatron_forward_kl(xs, xt, ws, wt)


class _RowsOfWhole(torch.autograd.Function):
    """The gathered whole weight in the forward; this rank's rows of its gradient in the backward."""

    @staticmethod
    def forward(ctx, shard, whole, rank):
        ctx.rows, ctx.rank = shard.shape[0], rank
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows: (ctx.rank + 1) * ctx.rows], None, None


def worker(rank, world, init_file, args):
    global nitrobrew
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=device)
    else:  # a smoke run of the script itself: gloo processes on the CPU
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import nitrobrew as _nitrobrew

    nitrobrew = _nitrobrew
    n, v, d_s, d_t = args.shape
    rows = v // world  # V divisible by the GPU counts measured (152064 = 2^7 * 1188)
    same = torch.Generator(device).manual_seed(0)  # the same tokens on every rank
    xs = torch.randn(n, d_s, generator=same, device=device).to(torch.bfloat16)
    xt = torch.randn(n, d_t, generator=same, device=device).to(torch.bfloat16)
    own = torch.Generator(device).manual_seed(1 + rank)  # this rank's rows
    ws = (torch.randn(rows, d_s, generator=own, device=device) * 3 / d_s ** 0.5).to(torch.bfloat16)
    wt = (torch.randn(rows, d_t, generator=own, device=device) * 3 / d_t ** 0.5).to(torch.bfloat16)
    methods = [m for m in args.methods if world > 1 or m.startswith("nitrobrew")]
    results = []
    for mode in ("forward", "fwd_bwd"):
        steps = {}
        for method in methods:
            x = xs.clone().requires_grad_(mode == "fwd_bwd")
            w = ws.clone().requires_grad_(mode == "fwd_bwd")

            def step(method=method, x=x, w=w):
                loss = run_method(method, x, xt, w, wt, world)
                if mode == "fwd_bwd":
                    loss.backward()
                    x.grad = w.grad = None
                return loss

            steps[method] = step
        rounds = {m: [] for m in methods}
        peak = {m: 0.0 for m in methods}
        status = {m: "ok" for m in methods}
        for _ in range(args.rounds):  # the methods alternate round by round: a slow spell falls on all of them
            for method in methods:
                if status[method] != "ok":
                    continue
                try:
                    dist.barrier()
                    baseline = harness.memory_baseline(device)
                    times = harness.time_runs(steps[method], device, warmup=2, repeats=args.repeats)
                    peak[method] = max(peak[method], harness.peak_extra_mib(device, baseline))
                    rounds[method].append(statistics.median(times))
                except harness.OOM_ERROR:
                    status[method] = "oom"
                harness.free_device_memory(device)
        for method in methods:
            sent, value = float("nan"), float("nan")
            if status[method] == "ok":
                with ByteCounter(world) as counter:
                    value = float(steps[method]().detach())
                sent = counter.sent / 2**20
            r = rounds[method]
            results.append(dict(method=method, mode=mode, status=status[method],
                                median_ms=statistics.median(r) if r else float("nan"),
                                min_ms=min(r) if r else float("nan"), peak_extra_mib=peak[method],
                                sent_mib_per_rank=sent, loss_value=value,
                                round_medians_ms=" ".join(f"{t:.3f}" for t in r)))
        steps = None
        harness.free_device_memory(device)
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split(",")), default=(8192, 152064, 3584, 5120),
                   help="N,V,Ds,Dt (N tokens on every rank)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run over gloo")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < max(args.gpus):
        sys.exit(f"--gpus {max(args.gpus)} needs that many GPUs, this machine has {torch.cuda.device_count()}")
    rows = []
    for world in args.gpus:
        rows.extend(dict(row, gpus=world) for row in harness.results_of_ranks(worker, world, args))
    single = {(r["mode"]): r["median_ms"] for r in rows if r["gpus"] == 1 and r["method"] == "nitrobrew"}
    n, v, d_s, d_t = args.shape
    for r in rows:
        if r["method"] in ("nitrobrew", "local_shard") and r["mode"] in single and r["status"] == "ok":
            r["scaling_efficiency"] = single[r["mode"]] / (r["gpus"] * r["median_ms"])
        r.update(date=datetime.date.today().isoformat(), device=harness.device_name(torch.device(args.device, 0)
                                                                                   if args.device == "cuda" else
                                                                                   torch.device("cpu")),
                 torch=torch.__version__, N=n, V=v, Ds=d_s, Dt=d_t)
        print(f"{r['gpus']} GPU {r['method']:<18} {r['mode']:<8} {r['median_ms']:8.2f} ms  peak {r['peak_extra_mib']:8.0f} "
              f"MiB  sent {r['sent_mib_per_rank']:9.2f} MiB  eff {r.get('scaling_efficiency', float('nan')):.2f}")
    harness.write_csv(args.out, COLUMNS, rows)


if __name__ == "__main__":
    main()
