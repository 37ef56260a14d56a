"""A teacher in another process: it sends its final hidden states, and the trainer, which holds a copy of
the teacher's lm_head, computes nitrobrew's fused loss from both models' hidden states.

On-policy distillation often runs the teacher as a separate service. Its final hidden states (D_t numbers a
token) carry its whole next-token distribution, where top-K log-probabilities (2K numbers) drop the tail
and full logits (V numbers) cost 16-42x the bytes (docs/remote_teacher.md). Here rank 0 is the teacher and
rank 1 the trainer, over torch.distributed (gloo on the CPU, NCCL between two GPUs):

    once:           teacher -> trainer   its unembedding (lm_head weight, bias, logit scale, soft-cap)
    every batch:    trainer -> teacher   the batch's token ids (on-policy: the trainer's own samples)
                    teacher -> trainer   the final hidden states [B, T, D_t], in the models' dtype

and the trainer steps the student with nitrobrew.forward_kl (or jsd) on the student's hidden states and the
received ones. With --check the trainer also builds the teacher itself and asserts that the received hidden
states, the loss and the student's gradients equal those of the single-process nitrobrew.hf.distillation_loss.

    python examples/remote_teacher.py --check                  # 2 CPU processes over gloo (the CI smoke run)
    python examples/remote_teacher.py --device cuda --dtype bfloat16 --full   # NCCL, GPUs 0 and 1

Needs transformers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nitrobrew

TEACHER, TRAINER = 0, 1


def llama(vocab: int, hidden: int, layers: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config)


def sizes(full: bool) -> dict:
    return dict(vocab=32000, teacher=(1024, 4), student=(512, 2), batch=4, length=1024, steps=20) if full else \
        dict(vocab=512, teacher=(64, 2), student=(32, 1), batch=4, length=48, steps=6)


def final_hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states, without the lm_head."""
    return model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state


def send_unembedding(u: nitrobrew.hf.Unembedding, device) -> None:
    """The teacher's lm_head, once: its shape and transform, then its weight (and bias)."""
    v, d = u.weight.shape
    header = torch.tensor([v, d, u.bias is not None, u.softcap is not None], dtype=torch.int64, device=device)
    dist.send(header, TRAINER)
    dist.send(torch.tensor([u.scale, u.softcap or 0.0], dtype=torch.float64, device=device), TRAINER)
    dist.send(u.weight.detach().contiguous(), TRAINER)
    if u.bias is not None:
        dist.send(u.bias.detach().contiguous(), TRAINER)


def receive_unembedding(device, dtype) -> nitrobrew.hf.Unembedding:
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.recv(header, TEACHER)
    v, d, has_bias, has_softcap = header.tolist()
    transform = torch.empty(2, dtype=torch.float64, device=device)
    dist.recv(transform, TEACHER)
    weight = torch.empty(v, d, dtype=dtype, device=device)
    dist.recv(weight, TEACHER)
    bias = None
    if has_bias:
        bias = torch.empty(v, dtype=dtype, device=device)
        dist.recv(bias, TEACHER)
    scale, softcap = transform.tolist()
    return nitrobrew.hf.Unembedding(weight=weight, bias=bias, scale=scale, softcap=softcap if has_softcap else None)


def teacher_process(args, size, device, dtype) -> None:
    teacher = llama(size["vocab"], *size["teacher"], seed=2).to(device, dtype).eval().requires_grad_(False)
    send_unembedding(nitrobrew.hf.unembedding(teacher), device)
    shape = torch.empty(2, dtype=torch.int64, device=device)
    while True:
        dist.recv(shape, TRAINER)
        if shape[0] == 0:  # the trainer is done
            return
        input_ids = torch.empty(*shape.tolist(), dtype=torch.int64, device=device)
        dist.recv(input_ids, TRAINER)
        with torch.no_grad():
            dist.send(final_hidden_states(teacher, input_ids).contiguous(), TRAINER)


def remote_hidden_states(input_ids: torch.Tensor, d_t: int, dtype) -> torch.Tensor:
    """The teacher's final hidden states for input_ids, from the teacher process."""
    dist.send(torch.tensor(input_ids.shape, dtype=torch.int64, device=input_ids.device), TEACHER)
    dist.send(input_ids.contiguous(), TEACHER)
    h_t = torch.empty(*input_ids.shape, d_t, dtype=dtype, device=input_ids.device)
    dist.recv(h_t, TEACHER)
    return h_t


def distillation_loss(student, u_t: nitrobrew.hf.Unembedding, input_ids, h_t, loss: str) -> torch.Tensor:
    """The loss nitrobrew.hf.distillation_loss computes, from the teacher's received hidden states: every
    position but the last predicts the next token."""
    u_s = nitrobrew.hf.unembedding(student)
    h_s = final_hidden_states(student, input_ids)[:, :-1]
    options = dict(bias_s=u_s.bias, bias_t=u_t.bias, logit_scale_s=u_s.scale, logit_scale_t=u_t.scale,
                   softcap_s=u_s.softcap, softcap_t=u_t.softcap)
    if loss == "jsd":
        return nitrobrew.jsd(h_s, h_t[:, :-1], u_s.weight, u_t.weight, beta=0.5, **options)
    return nitrobrew.forward_kl(h_s, h_t[:, :-1], u_s.weight, u_t.weight, **options)


def trainer_process(args, size, device, dtype) -> None:
    u_t = receive_unembedding(device, dtype)
    student = llama(size["vocab"], *size["student"], seed=3).to(device, dtype)
    optimizer = torch.optim.AdamW(student.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    wire_bytes = tokens = 0
    losses = []
    for step in range(size["steps"]):
        # On-policy data would come from the student's own samples; random tokens keep the example short.
        input_ids = torch.randint(0, size["vocab"], (size["batch"], size["length"]), generator=g).to(device)
        h_t = remote_hidden_states(input_ids, u_t.weight.shape[1], dtype)
        wire_bytes += h_t.numel() * h_t.element_size()
        tokens += input_ids.numel()
        loss = distillation_loss(student, u_t, input_ids, h_t, args.loss)
        loss.backward()
        if args.check and step == 0:
            check_against_one_process(student, input_ids, h_t, loss, size, device, dtype, args.loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if not args.quiet:
            print(f"step {step}: loss {losses[-1]:.4f}")
    dist.send(torch.zeros(2, dtype=torch.int64, device=device), TEACHER)  # done
    d_t, v = u_t.weight.shape[1], u_t.weight.shape[0]
    print(f"trainer: {size['steps']} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}; hidden states received: "
          f"{wire_bytes / tokens:.0f} bytes a token (D_t = {d_t}, {dtype}); full logits would be "
          f"{v * torch.finfo(dtype).bits // 8} bytes a token (V = {v})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loss.csv").write_text("step,loss\n" + "".join(f"{i},{x:.6f}\n" for i, x in enumerate(losses)))


def check_against_one_process(student, input_ids, h_t, loss, size, device, dtype, loss_name) -> None:
    """The received hidden states, the loss and the student's gradients equal those of the single-process
    loss (the teacher built here from the same seed)."""
    teacher = llama(size["vocab"], *size["teacher"], seed=2).to(device, dtype).eval().requires_grad_(False)
    with torch.no_grad():
        assert torch.equal(h_t, final_hidden_states(teacher, input_ids)), "the received hidden states differ"
    grads = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad(set_to_none=True)
    expected = nitrobrew.hf.distillation_loss(student, teacher, input_ids, loss=loss_name)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=0, atol=0)
    for name, p in student.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=lambda m: f"{name}.grad: {m}")
    print("check: the hidden states received, the loss and every gradient of the student equal the "
          "single-process nitrobrew.hf.distillation_loss")


def worker(rank: int, args, init_file: str) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    torch.set_num_threads(args.threads)  # the same thread count in both processes: the same CPU results
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        size, dtype = sizes(args.full), getattr(torch, args.dtype)
        (teacher_process if rank == TEACHER else trainer_process)(args, size, device, dtype)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    from _requires import require  # this folder's helper (on sys.path when run as a script)

    require("transformers")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the teacher on GPU 0, "
                        "the trainer on GPU 1")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--loss", default="forward_kl", choices=["forward_kl", "jsd"])
    parser.add_argument("--full", action="store_true", help="larger models and batches (use GPUs)")
    parser.add_argument("--check", action="store_true", help="compare the first step with the single-process loss")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per process")
    parser.add_argument("--out", type=Path, default=Path("remote_teacher_out"))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        parser.error("--device cuda runs the teacher and the trainer on two GPUs; this machine has "
                     f"{torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args, os.path.join(tmp, "init")), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
