"""A training step under FSDP2 on several GPUs (one process a GPU, each rank its own tokens): a Hugging
Face student (Qwen2.5 0.5B shapes, untied embeddings, its lm_head a unit of its own) distilled from a teacher
(1.5B shapes, or 7B with --pair qwen7b), whole on every rank or sharded too (--teacher-layout fsdp2), with
forward KL, an SGD step; per GPU the step time and peak memory of

  nitrobrew_hf  nitrobrew.hf.distillation_loss on the wrapped models (each decoder inside its FSDP2 forward,
                the loss on the sharded lm_heads: the ranks gather activations, not lm_heads; docs/hf.md);
  nitrobrew     the decoders called directly, then nitrobrew.forward_kl on the sharded lm_head (a whole
                teacher only: a sharded one's decoder cannot run outside its root's forward);
  nitrobrew_training  the same on the training path;
  logits        the models' own forwards (FSDP2 gathers the lm_heads) and a float32 kl_div on the logits.

    python benchmarks/fsdp2_step.py --gpus 2 4 --tokens 4096 16384 --out benchmarks/results/fsdp2_step_qwen_4xh200_DATE.csv
    python benchmarks/fsdp2_step.py --gpus 4 --pair qwen7b --teacher-layout fsdp2 --methods nitrobrew_hf logits \
        --tokens 4096 16384 65536 --out benchmarks/results/fsdp2_step_qwen7b_4xh200_DATE.csv   # issue 44
    python benchmarks/fsdp2_step.py --device cpu --tiny --gpus 2 --out /tmp/fsdp2_step.csv   # a gloo smoke run

NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are set before any process starts).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from pathlib import Path

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import harness  # noqa: E402
import hf_step  # noqa: E402

COLUMNS = ["date", "device", "gpus", "torch", "pair", "teacher_layout", "teacher_layers", "method", "tokens_per_rank", "status", "step_ms_median", "step_ms_min",
           "peak_gib_max_over_ranks", "loss_mean_over_ranks", "round_medians_ms"]


def loss_nitrobrew(student, teacher, ids, grad_in_forward=None):
    import nitrobrew

    h = student.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    with torch.no_grad():
        h_t = teacher.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    return nitrobrew.forward_kl(h, h_t, student.lm_head.weight, teacher.lm_head.weight,
                                grad_in_forward=grad_in_forward)


def loss_nitrobrew_training(student, teacher, ids):
    # The training path over FSDP2's token shards, asked for (the automatic choice keeps the recompute path).
    return loss_nitrobrew(student, teacher, ids, grad_in_forward=True)


def loss_nitrobrew_hf(student, teacher, ids):
    import nitrobrew

    return nitrobrew.hf.distillation_loss(student, teacher, ids)


METHODS = {"nitrobrew_hf": loss_nitrobrew_hf, "nitrobrew": loss_nitrobrew, "nitrobrew_training": loss_nitrobrew_training,
           "logits": hf_step.loss_logits}
# Methods that call the teacher's decoder directly: a whole teacher only.
DIRECT = ("nitrobrew", "nitrobrew_training")


def sharded_student(args, device, mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # the same student on every rank, as from a checkpoint
    student = hf_step.build(args.pair, "student", args, device, tied=False)
    for layer in student.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(student.model, mesh=mesh)
    fully_shard(student.lm_head, mesh=mesh)
    fully_shard(student, mesh=mesh)
    return student


def worker(rank, world, init_file, args):
    from torch.distributed.device_mesh import init_device_mesh

    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh(args.device, (world,))
    torch.manual_seed(1)
    teacher = hf_step.build(args.pair, "teacher", args, device, tied=False, layers=args.teacher_layers)
    if args.teacher_layout == "fsdp2":  # each layer, the lm_head, the root
        from torch.distributed.fsdp import fully_shard

        for layer in teacher.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(teacher.lm_head, mesh=mesh)
        fully_shard(teacher, mesh=mesh)
    results = []
    for tokens in args.tokens:
        ids = torch.randint(0, teacher.config.vocab_size, (1, tokens),
                            generator=torch.Generator().manual_seed(100 + rank)).to(device)  # each rank's own
        # Both students live side by side, and the methods alternate round by round, so that a slow
        # spell of the machine falls on both.
        students = {method: sharded_student(args, device, mesh) for method in args.methods}
        optimizers = {method: torch.optim.SGD(students[method].parameters(), lr=1e-4) for method in args.methods}
        rounds = {method: [] for method in args.methods}
        peak = {method: 0.0 for method in args.methods}
        loss_value = {method: float("nan") for method in args.methods}
        status = {method: "ok" for method in args.methods}
        for _ in range(args.rounds):
            for method in args.methods:
                if status[method] != "ok":
                    continue
                student, opt, times = students[method], optimizers[method], []
                try:
                    baseline = harness.memory_baseline(device)
                    for i in range(args.warmup + args.repeats):
                        dist.barrier()
                        start = datetime.datetime.now()
                        loss = METHODS[method](student, teacher, ids)
                        loss.backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                        if i >= args.warmup:
                            times.append((datetime.datetime.now() - start).total_seconds() * 1e3)
                        loss_value[method] = float(loss.detach())
                    peak[method] = max(peak[method], harness.peak_extra_mib(device, baseline) / 1024)
                    rounds[method].append(statistics.median(times))
                except harness.OOM_ERROR:
                    status[method] = "oom"
                loss = None
                harness.free_device_memory(device)
        students = optimizers = None
        harness.free_device_memory(device)
        for method in args.methods:
            # Every rank's view: the slowest rank's median over rounds, the largest peak, the mean loss.
            r = rounds[method]
            stats = torch.tensor([statistics.median(r) if r else float("nan"), min(r, default=float("nan")),
                                  peak[method], loss_value[method], float(status[method] != "ok")], device=device,
                                 dtype=torch.float64)
            gathered = [torch.empty_like(stats) for _ in range(world)]
            dist.all_gather(gathered, stats)
            g = torch.stack(gathered)
            results.append(dict(method=method, tokens_per_rank=tokens,
                                status="oom" if g[:, 4].max() > 0 else "ok",
                                step_ms_median=float(g[:, 0].max()), step_ms_min=float(g[:, 1].max()),
                                peak_gib_max_over_ranks=float(g[:, 2].max()), loss_mean_over_ranks=float(g[:, 3].mean()),
                                round_medians_ms=" ".join(f"{t:.1f}" for t in r)))
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, nargs="+", help="per rank (default 4096 16384; --tiny: 64)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of every round")
    p.add_argument("--repeats", type=int, default=3, help="timed steps a round")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the methods alternate round by round")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a gloo smoke run (with --tiny)")
    p.add_argument("--tiny", action="store_true", help="tiny models (hf_step.py's)")
    p.add_argument("--pair", choices=["qwen", "qwen7b"], default="qwen", help="qwen7b: the 0.5B student, a 7B teacher")
    p.add_argument("--teacher-layout", choices=["whole", "fsdp2"], default="whole")
    p.add_argument("--teacher-layers", type=int, help="fewer teacher layers than the pair's (memory)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if args.teacher_layout == "fsdp2" and set(args.methods) & set(DIRECT):
        p.error(f"methods {DIRECT} call the teacher's decoder outside its FSDP2 root's forward: use "
                f"--teacher-layout whole, or --methods nitrobrew_hf logits")
    args.tokens = args.tokens or ([64] if args.tiny else [4096, 16384])
    args.llama_layers = 2  # hf_step.build's argument; the Qwen pair does not read it
    rows = []
    for world in args.gpus:
        rows.extend(dict(row, gpus=world) for row in harness.results_of_ranks(worker, world, args))
    device = harness.device_name(torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu"))
    for r in rows:
        r.update(date=datetime.date.today().isoformat(), device=device, torch=torch.__version__, pair=args.pair,
                 teacher_layout=args.teacher_layout, teacher_layers=args.teacher_layers or "all")
        print(f"{r['gpus']} GPUs {r['method']:<10} T={r['tokens_per_rank']:<6} {r['status']:<4} "
              f"{r['step_ms_median']:9.1f} ms  peak {r['peak_gib_max_over_ranks']:6.2f} GiB  "
              f"loss {r['loss_mean_over_ranks']:.5f}")
    harness.write_csv(args.out, COLUMNS, rows)


if __name__ == "__main__":
    main()
