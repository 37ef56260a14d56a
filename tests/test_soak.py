"""Soak: 1,000 forward + backward steps of every family on CUDA leave the allocated memory where the
first steps left it (nothing held per step: saved tensors, inference tensors, workspaces)."""

from __future__ import annotations

import pytest
import torch

import nitrobrew
from conftest import CUDA

pytestmark = CUDA


def _steps():
    """{family: one forward + backward step} on small bf16 problems."""
    g = torch.Generator(device="cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    xs, xt = torch.randn(300, 64, **kw).requires_grad_(), torch.randn(300, 96, **kw)
    ws, wt = (torch.randn(1500, 64, **kw) / 8).requires_grad_(), torch.randn(1500, 96, **kw) / 10
    zs, zt = torch.randn(300, 1500, **kw).requires_grad_(), torch.randn(300, 1500, **kw)
    lps, ids = torch.randn(300, 1500, device="cuda", generator=g).log_softmax(-1).topk(16, dim=-1)
    q_s, k_s = (torch.randn(2, 128, 4, 64, **kw).requires_grad_() for _ in range(2))
    q_t, k_t = torch.randn(2, 128, 4, 64, **kw), torch.randn(2, 128, 2, 64, **kw)
    with torch.inference_mode():
        zt_inference = zt.clone()  # a frozen teacher's logits

    def step(loss_fn, *leaves):
        def run():
            loss_fn().backward()
            for leaf in leaves:
                leaf.grad = None
        return run

    return {
        "fused_linear": step(lambda: nitrobrew.jsd(xs, xt, ws, wt, beta=0.3), xs, ws),
        "topk_linear": step(lambda: nitrobrew.topk_kl(xs, ws, ids, lps), xs, ws),
        "logits": step(lambda: nitrobrew.logits.reverse_kl(zs, zt_inference), zs),
        "topk_logits": step(lambda: nitrobrew.logits.topk_kl(zs, ids, lps, normalize="topk"), zs),
        "attention_kl": step(lambda: nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True), q_s, k_s),
    }


@pytest.mark.parametrize("family", ["fused_linear", "topk_linear", "logits", "topk_logits", "attention_kl"])
def test_no_memory_growth_over_1000_steps(family):
    run = _steps()[family]
    for _ in range(20):  # the caching allocator's and the kernels' first allocations
        run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(1000):
        run()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before, f"{family}: {torch.cuda.memory_allocated() - before} bytes more"
