"""Distill a Hugging Face causal LM on several processes with FSDP2 (or DDP) and nitrobrew.hf.

Every rank holds a shard of the student and of the teacher (FSDP2's fully_shard on each decoder layer, on the
tied embedding and lm_head as one unit, and on the root) and trains on its own batches.
`nitrobrew.hf.distillation_loss` runs each model's decoder inside its FSDP2 forward and computes the loss on
the lm_heads' shards: no rank forms the [batch x tokens x vocab] logits, and nitrobrew gathers no lm_head (FSDP2
gathers these tied ones for the embeddings; an untied lm_head as a unit of its own is never gathered, docs/hf.md). The teacher is a random model with sharp next-token distributions; the student learns
to match them. Rank 0 shows a progress bar, writes the loss log, and checks that the held-out KL fell.

    torchrun --nproc-per-node 2 examples/distill_fsdp2.py                       # CPU over gloo (the CI smoke run)
    torchrun --nproc-per-node 4 examples/distill_fsdp2.py --sizes qwen2.5 --device cuda --dtype bfloat16
    torchrun --nproc-per-node 2 examples/distill_fsdp2.py --student ddp --teacher plain

Needs transformers (tqdm for the progress bar, optional).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import nitrobrew

# (vocabulary, student (hidden, layers, heads, kv heads), teacher (...), batch a rank, tokens, steps, learning
# rate, the held-out KL's required fall: after < fall * before)
SIZES = {
    "tiny": dict(vocab=499, student=(32, 2, 4, 2), teacher=(64, 2, 4, 2), batch=4, length=32, steps=40, lr=3e-3,
                 fall=0.7),
    # Qwen2.5 0.5B <- 1.5B shapes (random init; the real vocabulary and widths). The random teacher's peaked
    # next-token choice over 152k tokens is learned slowly: 50 steps only start the fall. At 3e-3 the student's
    # KL rose (2 H200s: 11.38 -> 11.42; the CPU with 2 layers, 15 steps: 11.36 -> 12.22); at 3e-4 it fell on the
    # CPU (11.36 -> 11.15).
    "qwen2.5": dict(vocab=151936, student=(896, 24, 14, 2), teacher=(1536, 28, 12, 2), batch=4, length=2048,
                    steps=50, lr=3e-4, fall=0.99),
}


def qwen2(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, seed: int, sharp: float):
    """A Qwen2 model with tied embeddings, random init, its logits scaled by `sharp` (a peaked teacher)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 5.4) // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=32768, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharp)
    return model


def wrap(model, layout: str, device):
    if layout == "plain":
        return model
    if layout == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    # A unit of its own: the lm_head is never gathered (tied, the embedding's forward gathers it anyway).
    fully_shard([embed, head] if head.weight is embed.weight else head)
    fully_shard(model)
    return model


def progress(iterable, description: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=description, disable=not enabled)


def main(argv=None) -> int:
    from _requires import require  # this folder's helper (on sys.path when run as a script)

    require("transformers")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--student", default="fsdp2", choices=["fsdp2", "ddp"])
    parser.add_argument("--teacher", default="fsdp2", choices=["fsdp2", "plain"])
    parser.add_argument("--teacher-layers", type=int, default=None, help="fewer teacher layers (memory)")
    parser.add_argument("--loss", default="forward_kl", choices=["forward_kl", "reverse_kl", "jsd"])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("distill_fsdp2_out"))
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    size, dtype = SIZES[args.sizes], getattr(torch, args.dtype)
    steps = args.steps or size["steps"]
    t_hidden, t_layers, t_heads, t_kv = size["teacher"]
    teacher = qwen2(size["vocab"], t_hidden, args.teacher_layers or t_layers, t_heads, t_kv, seed=1, sharp=16.0)
    student = qwen2(size["vocab"], *size["student"], seed=2, sharp=1.0)
    teacher = wrap(teacher.to(device, dtype).eval().requires_grad_(False), args.teacher, device)
    student = wrap(student.to(device, dtype), args.student, device)
    optimizer = torch.optim.AdamW(student.parameters(), lr=size["lr"])

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    batch = lambda: torch.randint(0, size["vocab"], (size["batch"], size["length"]), generator=g).to(device)  # noqa: E731
    held_out = batch()

    def held_out_kl() -> float:
        with torch.no_grad():
            kl = nitrobrew.hf.distillation_loss(student, teacher, held_out)
        dist.all_reduce(kl)
        return kl.item() / world

    before = held_out_kl()
    losses = []
    bar = progress(range(steps), f"distill ({args.loss}, {args.student} student, {world} ranks)",
                   rank == 0 and not args.quiet)
    for step in bar:
        loss = nitrobrew.hf.distillation_loss(student, teacher, batch(), loss=args.loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the mean over the ranks, for the log
        losses.append(logged.item() / world)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        elif rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    after = held_out_kl()
    if rank == 0:
        peak = f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB a GPU" if device.type == "cuda" else ""
        print(f"student: held-out KL(teacher || student) {before:.4f} -> {after:.4f} nats per token "
              f"({world} ranks{peak})")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loss.csv").write_text("step,loss\n" + "".join(f"{i},{v:.6f}\n" for i, v in enumerate(losses)))
        print(f"wrote {args.out / 'loss.csv'}")
    fell = after < size["fall"] * before
    if not fell:
        print(f"the student's KL to the teacher did not fall enough: {before:.4f} -> {after:.4f}", file=sys.stderr)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: DDP's reducer holds the gloo process group, and destroying it there
    # (the GIL held) can deadlock on gloo's worker thread, which needs the GIL to free its last work (seen in CI).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if fell else 1)


if __name__ == "__main__":
    main()
