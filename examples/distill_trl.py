"""The distillation of distill_hf.py through TRL's GKDTrainer, switched to nitrobrew in one import.

The teacher learns the synthetic Markov language as in distill_hf.py; the student is then trained by
`nitrobrew.trl.GKDTrainer` (TRL's trainer: its data collator, chat template, optimizer and logging; the
generalized JSD computed by nitrobrew from hidden states) on chat-formatted samples of the language, with a
word-level tokenizer made here (no hub). The held-out KL to the teacher must fall.

    python examples/distill_trl.py             # CPU, seconds (the CI smoke run)
    accelerate launch --multi_gpu --num_processes 2 examples/distill_trl.py   # 2 processes: DDP (gloo on CPUs)

Needs transformers, TRL (and datasets, which TRL installs).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _requires import require  # noqa: E402  (this folder's helpers)
from distill_hf import held_out_kl, llama, markov_chain, sample_text  # noqa: E402

VOCAB = 256
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "user", "assistant"]


def word_tokenizer(vocab: int = VOCAB):
    """A fast word-level tokenizer whose words are the special tokens, then t0, t1, ... (token id = index),
    with a minimal chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIAL + [f"t{i}" for i in range(vocab - len(SPECIAL))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant {% endif %}")
    return fast


def chats(chain, count: int, prompt: int, reply: int, g):
    """Chat samples of the language: a user turn of `prompt` tokens, the assistant's continuation of `reply`."""
    text = sample_text(chain, count, prompt + reply, g) + len(SPECIAL)  # word t_i has id i + len(SPECIAL)
    as_words = lambda ids: " ".join(f"t{int(i) - len(SPECIAL)}" for i in ids)  # noqa: E731
    return [[{"role": "user", "content": as_words(row[:prompt])}, {"role": "assistant", "content": as_words(row[prompt:])}]
            for row in text]


def main(argv=None) -> int:
    require("transformers", "trl", "datasets")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("distill_trl_out"))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig

    from nitrobrew.trl import GKDTrainer  # the one line: instead of trl.experimental.gkd's

    chain = markov_chain(VOCAB - len(SPECIAL), branching=4, seed=0)
    g = torch.Generator().manual_seed(1)
    teacher = llama(VOCAB, 64, 2, seed=2)
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=3e-3)
    for _ in range(args.teacher_steps):
        text = sample_text(chain, 8, 32, g) + len(SPECIAL)
        teacher(input_ids=text, labels=text).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    teacher.eval().requires_grad_(False)

    student = llama(VOCAB, 32, 1, seed=3)
    held_out = sample_text(chain, 16, 32, g) + len(SPECIAL)
    before = held_out_kl(student, teacher, held_out)
    config = GKDConfig(output_dir=str(args.out), max_steps=args.steps, per_device_train_batch_size=8, lmbda=0.0,
                       beta=0.5, learning_rate=3e-3, lr_scheduler_type="constant", report_to=[], logging_steps=10,
                       save_strategy="no",
                       use_cpu=not torch.cuda.is_available(), max_length=48, disable_tqdm=args.quiet)
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=config,
                         train_dataset=Dataset.from_dict({"messages": chats(chain, 8 * args.steps, 8, 24, g)}),
                         processing_class=word_tokenizer())
    state = trainer.accelerator.state
    if state.is_main_process:
        print(f"trainer: {state.distributed_type.value} over {state.num_processes} process(es)")
    trainer.train()
    # accelerate wrapped the student's forward for its mixed precision; the held-out check runs it as it was.
    student = trainer.accelerator.unwrap_model(student, keep_fp32_wrapper=False)
    after = held_out_kl(student.to(held_out.device), teacher.to(held_out.device), held_out)
    print(f"student: held-out KL(teacher || student) {before:.4f} -> {after:.4f} nats per token")
    assert after < 0.5 * before, f"the student's KL to the teacher did not fall enough: {before:.4f} -> {after:.4f}"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
