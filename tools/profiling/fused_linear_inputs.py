"""The fused-linear profiling tools' problem: shape arguments (the Qwen reference shape by default) and
seeded bf16 inputs whose logits have unit scale."""

import torch


def add_shape_arguments(parser, tokens=2048):
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--d-student", type=int, default=3584)
    parser.add_argument("--d-teacher", type=int, default=5120)


def make_inputs(args, device="cuda"):
    """xs, xt, ws, wt for the parsed shape arguments; xs and ws require grad."""
    torch.manual_seed(0)
    kw = dict(device=device, dtype=torch.bfloat16)
    xs = torch.randn(args.tokens, args.d_student, **kw, requires_grad=True)
    xt = torch.randn(args.tokens, args.d_teacher, **kw)
    ws = (torch.randn(args.vocab, args.d_student, **kw) / args.d_student**0.5).requires_grad_()
    wt = torch.randn(args.vocab, args.d_teacher, **kw) / args.d_teacher**0.5
    return xs, xt, ws, wt

