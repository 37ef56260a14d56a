"""Distill a Hugging Face causal LM into a smaller one with nitrobrew, end to end, on synthetic text.

A teacher (Llama architecture, random init) first learns a synthetic language: token sequences drawn from
a sparse random Markov chain, so that its next-token distributions are far from uniform. A smaller student
is then trained on the teacher alone with `nitrobrew.hf.distillation_loss`, never forming either model's
[batch x tokens x vocab] logits. The script logs the loss, saves a loss-curve plot, and checks that the
student's KL to the teacher on held-out text fell.

    python examples/distill_hf.py                 # CPU, seconds (the CI smoke run)
    python examples/distill_hf.py --attention 0.5 # plus the KL of attention maps (student layer i <- teacher 2i+1)
    python examples/distill_hf.py --full --device cuda --dtype bfloat16   # larger models, longer text

Needs transformers (and matplotlib for the plot, tqdm for the progress bar, both optional).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

import nitrobrew


def markov_chain(vocab: int, branching: int, seed: int) -> torch.Tensor:
    """A [V, V] transition matrix where each token has `branching` likely successors."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.full((vocab, vocab), -6.0)
    for token in range(vocab):
        successors = torch.randperm(vocab, generator=g)[:branching]
        logits[token, successors] = torch.randn(branching, generator=g) * 1.5 + 3.0
    return logits.softmax(-1)


def sample_text(chain: torch.Tensor, batch: int, length: int, g: torch.Generator) -> torch.Tensor:
    tokens = torch.empty(batch, length, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, chain.shape[0], (batch,), generator=g)
    for t in range(1, length):
        tokens[:, t] = torch.multinomial(chain[tokens[:, t - 1]], 1, generator=g).squeeze(1)
    return tokens


def llama(vocab: int, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config)


def progress(iterable, description: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, desc=description, disable=not enabled)


@torch.no_grad()
def held_out_kl(student, teacher, text: torch.Tensor) -> float:
    """Forward KL(teacher || student) per token on held-out text (nitrobrew.hf, no logits formed)."""
    return nitrobrew.hf.distillation_loss(student, teacher, text).item()


@torch.no_grad()
def held_out_attention_kl(student, teacher, text: torch.Tensor) -> float:
    """The attention-map KL of student layer i against teacher layer 2i + 1 on held-out text, per query row."""
    layer_map = {i: 2 * i + 1 for i in range(student.config.num_hidden_layers)}
    with nitrobrew.hf.capture_attention(student, layer_map.keys()) as s, \
            nitrobrew.hf.capture_attention(teacher, layer_map.values()) as t:
        student(input_ids=text)
        teacher(input_ids=text)
    return nitrobrew.hf.attention_distillation_loss(s, t, layer_map).item()


def distill_with_attention(student, teacher, text, args):
    """The logit-level loss plus args.attention x the attention-map KL of each student layer i against
    teacher layer 2i + 1, captured during the models' own forward passes (nitrobrew.hf.capture_attention)."""
    layer_map = {i: 2 * i + 1 for i in range(student.config.num_hidden_layers)}
    with nitrobrew.hf.capture_attention(student, layer_map.keys()) as s, \
            nitrobrew.hf.capture_attention(teacher, layer_map.values()) as t:
        logit_loss = nitrobrew.hf.distillation_loss(student, teacher, text, loss=args.loss, check=False)
    attention_loss = nitrobrew.hf.attention_distillation_loss(s, t, layer_map)
    return logit_loss + args.attention * attention_loss


def main(argv=None) -> int:
    from _requires import require  # this folder's helper (on sys.path when run as a script)

    require("transformers")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="larger models and text (use a GPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--teacher-steps", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="distillation steps")
    parser.add_argument("--loss", default="forward_kl", choices=["forward_kl", "reverse_kl", "jsd"])
    parser.add_argument("--attention", type=float, default=0.0,
                        help="weight of an attention-map KL between student layer i and teacher layer 2i + 1. The tiny "
                             "models' attention maps are near uniform (their KL ~0.01 nats against the logit loss's "
                             "~1), so it barely moves the logits' KL; the held-out attention-map KL printed at the "
                             "end shows its effect (0.006 -> 0.005 with 0.5, -> 0.008 without)")
    parser.add_argument("--out", type=Path, default=Path("distill_hf_out"))
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    size = dict(vocab=4096, teacher=(512, 4), student=(256, 2), batch=16, length=256, teacher_steps=400,
                steps=400) if args.full else \
        dict(vocab=256, teacher=(64, 2), student=(32, 1), batch=8, length=32, teacher_steps=100, steps=80)
    teacher_steps = args.teacher_steps or size["teacher_steps"]
    steps = args.steps or size["steps"]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    chain = markov_chain(size["vocab"], branching=4, seed=0)
    g = torch.Generator().manual_seed(1)
    held_out = sample_text(chain, 32, size["length"], g).to(device)

    # 1. The teacher learns the language (cross-entropy on the next token).
    teacher = llama(size["vocab"], *size["teacher"], seed=2).to(device, dtype)
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    for _ in progress(range(teacher_steps), "teacher", not args.quiet):
        text = sample_text(chain, size["batch"], size["length"], g).to(device)
        loss = teacher(input_ids=text, labels=text).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    teacher.eval().requires_grad_(False)
    entropy = -(chain * chain.clamp_min(1e-30).log()).sum(-1).mean().item()
    print(f"teacher: next-token cross-entropy {loss.item():.3f} nats (the chain's entropy: {entropy:.3f}; "
          f"uniform: {math.log(size['vocab']):.3f})")

    # 2. The student learns from the teacher alone, through nitrobrew's fused loss.
    student = llama(size["vocab"], *size["student"], seed=3).to(device, dtype)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    before = held_out_kl(student, teacher, held_out)
    attention_before = held_out_attention_kl(student, teacher, held_out)
    losses = []
    bar = progress(range(steps), f"distill ({args.loss})", not args.quiet)
    for step in bar:
        text = sample_text(chain, size["batch"], size["length"], g).to(device)
        if args.attention > 0:
            loss = distill_with_attention(student, teacher, text, args)
        else:
            loss = nitrobrew.hf.distillation_loss(student, teacher, text, loss=args.loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        elif step % 25 == 0:
            print(f"step {step}: loss {losses[-1]:.4f}")
    after = held_out_kl(student, teacher, held_out)
    print(f"student: held-out KL(teacher || student) {before:.4f} -> {after:.4f} nats per token")
    # The attention term's effect: without it the student's attention maps drift wherever the logits lead them.
    print(f"student: held-out attention-map KL (layer i against teacher layer 2i + 1) {attention_before:.4f} -> "
          f"{held_out_attention_kl(student, teacher, held_out):.4f} nats per query row"
          f"{f' (trained with weight {args.attention})' if args.attention > 0 else ' (not trained: --attention 0)'}")

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss.csv").write_text("step,loss\n" + "".join(f"{i},{v:.6f}\n" for i, v in enumerate(losses)))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(losses)
        ax.set(xlabel="step", ylabel=f"{args.loss} (nats per token)", yscale="log",
               title="distillation with nitrobrew.hf")
        fig.tight_layout()
        fig.savefig(args.out / "loss.png", dpi=120)
        print(f"wrote {args.out / 'loss.png'} and loss.csv")
    except ImportError:
        print(f"wrote {args.out / 'loss.csv'} (matplotlib is not installed: no plot)")
    assert after < 0.5 * before, f"the student's KL to the teacher did not fall enough: {before:.4f} -> {after:.4f}"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
