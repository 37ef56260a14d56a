"""Offline top-K distillation: pass 1 stores a teacher's top-K log-probabilities as a dataset of shards, pass 2
trains a student from the shards alone, the teacher gone.

    pass 1 (teacher):  for each batch, nitrobrew.hf.teacher_topk -> shard_00000.safetensors, ...
    pass 2 (student):  for each shard, nitrobrew.topk_kl(student's hidden states, lm_head, ids, logprobs)

nitrobrew.hf.teacher_topk walks the teacher's vocabulary once per token, keeping the top K and the
log-normalizer: the teacher's [B, T, V] logits (10 GB in bf16 at 32k tokens and a 152k vocabulary) are never
formed. The shard format is safetensors, one file per batch; the schema (docs/offline_topk.md):

    input_ids      int32   [B, T]         the tokens
    attention_mask int8    [B, T]         1 = a real token
    topk_ids       int32   [B, T - 1, K]  position n: the teacher's K most likely next tokens, most likely first
    topk_logprobs  fp16 or fp32 [B, T - 1, K]   their log-probabilities over the teacher's whole vocabulary
    metadata (str): format, k, temperature, vocab_size, teacher

4 + 2 = 6 bytes a token per kept id in fp16 (192 bytes a token at K = 32), 8 in fp32.

    python examples/offline_topk.py --check              # tiny random Llamas on the CPU (the CI smoke run)
    python examples/offline_topk.py --full --device cuda

--check asserts the round trip: the loss from the stored shards equals the loss from the live teacher's
top-K (exactly with fp32 storage; within fp16's rounding with fp16). Needs transformers and safetensors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import nitrobrew

FORMAT = "nitrobrew-topk/1"


def llama(vocab: int, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def sizes(full: bool) -> dict:
    return dict(vocab=32000, teacher=(1024, 4), student=(512, 2), batch=4, length=1024, batches=16, epochs=2) if full \
        else dict(vocab=512, teacher=(64, 2), student=(32, 1), batch=4, length=40, batches=3, epochs=2)


def progress(items, quiet: bool, desc: str):
    """tqdm's bar where it is installed (transformers brings it), else plain."""
    if quiet:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc)


def batches(size: dict, device, seed: int = 0):
    """Token batches with right padding: the corpus a real pipeline would read."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(size["batches"]):
        ids = torch.randint(0, size["vocab"], (size["batch"], size["length"]), generator=g)
        mask = torch.ones_like(ids)
        lengths = torch.randint(size["length"] // 2, size["length"] + 1, (size["batch"],), generator=g)
        mask[torch.arange(size["length"]) >= lengths[:, None]] = 0
        yield ids.to(device), mask.to(device)


def write_shards(teacher, size: dict, out: Path, k: int, dtype: torch.dtype, temperature: float, device,
                 quiet: bool) -> list[Path]:
    """Pass 1: the teacher's top-K of every batch, one safetensors shard each."""
    from safetensors.torch import save_file

    metadata = dict(format=FORMAT, k=str(k), temperature=str(temperature), vocab_size=str(size["vocab"]),
                    teacher=type(teacher).__name__)
    paths = []
    for i, (ids, mask) in enumerate(progress(list(batches(size, device)), quiet, "pass 1: teacher top-K")):
        logprobs, top_ids = nitrobrew.hf.teacher_topk(teacher, ids, k, attention_mask=mask, temperature=temperature)
        path = out / f"shard_{i:05d}.safetensors"
        save_file({"input_ids": ids.to(torch.int32).cpu(), "attention_mask": mask.to(torch.int8).cpu(),
                   "topk_ids": top_ids.to(torch.int32).cpu(), "topk_logprobs": logprobs.to(dtype).cpu()},
                  str(path), metadata=metadata)
        paths.append(path)
    return paths


def read_shard(path: Path, device) -> dict:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} shard (format {metadata.get('format')!r})")
    shard = load_file(str(path), device=str(device))
    shard["metadata"] = metadata
    return shard


def shard_loss(student, shard: dict) -> torch.Tensor:
    """Pass 2's loss on one shard: topk_kl at the positions the shard's mask scores."""
    ids, mask = shard["input_ids"].long(), shard["attention_mask"].long()
    h = student.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, :-1]
    labels = nitrobrew.hf.scored_labels(ids, mask)
    u = nitrobrew.hf.unembedding(student)
    # The teacher's log-probabilities were stored at the recipe's temperature; topk_kl's divides the student's.
    return nitrobrew.topk_kl(h, u.weight, shard["topk_ids"].long(), shard["topk_logprobs"].float(), labels=labels,
                             bias_s=u.bias, logit_scale_s=u.scale,
                             temperature=float(shard["metadata"]["temperature"]))


def check_round_trip(teacher, student, shard: dict, dtype: torch.dtype, temperature: float) -> str:
    """The loss from a stored shard against the loss from the live teacher's top-K on the same batch."""
    ids, mask = shard["input_ids"].long(), shard["attention_mask"].long()
    k = int(shard["metadata"]["k"])
    with torch.no_grad():
        logprobs, top_ids = nitrobrew.hf.teacher_topk(teacher, ids, k, attention_mask=mask, temperature=temperature)
        live = shard_loss(student, dict(shard, topk_ids=top_ids, topk_logprobs=logprobs))
        stored = shard_loss(student, shard)
    assert torch.equal(shard["topk_ids"].long(), top_ids), "stored ids differ from the live teacher's"
    if dtype == torch.float32:
        assert torch.equal(stored, live), (stored.item(), live.item())
    else:  # fp16 rounds each log-probability to 11 significant bits
        torch.testing.assert_close(stored, live, rtol=2e-3, atol=1e-4)
    return f"check: the loss from the shard {stored.item():.6f} equals the live teacher's {live.item():.6f}"


def main() -> None:
    from _requires import require  # this folder's helper (on sys.path when run as a script)

    require("transformers", "safetensors")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--logprob-dtype", choices=["float16", "float32"], default="float16")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="32k vocabulary, 1024-token sequences")
    parser.add_argument("--check", action="store_true", help="assert the shards' loss equals the live teacher's")
    parser.add_argument("--out", type=Path, default=Path("offline_topk_out"))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    size = sizes(args.full)
    dtype = getattr(torch, args.logprob_dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = llama(size["vocab"], *size["teacher"], seed=0).to(args.device).eval()
    student = llama(size["vocab"], *size["student"], seed=1).to(args.device)

    paths = write_shards(teacher, size, args.out, args.k, dtype, args.temperature, args.device, args.quiet)
    tokens = sum(int(read_shard(p, "cpu")["attention_mask"].sum()) for p in paths)
    data_bytes = sum(p.stat().st_size for p in paths)
    print(f"pass 1: {len(paths)} shards, {tokens} tokens, {data_bytes / tokens:.0f} bytes a real token on disk (padding stored too) "
          f"(K = {args.k}, {args.logprob_dtype} log-probabilities)")
    if args.check:
        print(check_round_trip(teacher, student, read_shard(paths[0], args.device), dtype, args.temperature))
    del teacher  # pass 2 needs only the shards

    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    rows = []
    for epoch in range(size["epochs"]):
        for path in progress(paths, args.quiet, f"pass 2: epoch {epoch}"):
            loss = shard_loss(student, read_shard(path, args.device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            rows.append((epoch, path.name, loss.item()))
    (args.out / "loss.csv").write_text("epoch,shard,loss\n" + "".join(f"{e},{s},{v:.6f}\n" for e, s, v in rows))
    first, last = rows[0][2], rows[-1][2]
    print(f"pass 2: top-K KL {first:.4f} -> {last:.4f} over {len(rows)} steps; metadata "
          f"{json.dumps(read_shard(paths[0], 'cpu')['metadata'])}")


if __name__ == "__main__":
    main()
