"""Runs every CUDA kernel of the attention KL once on small, awkward problems, for compute-sanitizer:
on Hopper the TMA + wgmma forward and backwards (head dims up to 128: the fused backward with its
dq buffer, also chunked, and the deterministic dq kernel with the fused kernel's dk alone) and the mma.sync kernels for
larger head dims; with NITROBREW_FORCE_SM80=1 the mma.sync forward, dk with atomic dq (also
chunked), and dq and dk of the deterministic backward.

The GPU runner (tools/gpu/check.sh sanitize) runs these tests under compute-sanitizer, memcheck and
racecheck, on both kernel families:

    compute-sanitizer --tool memcheck python -m pytest -m sanitize tests/attention_kl
"""

import itertools
import os

import pytest
import torch

import nitrobrew
from conftest import CUDA

pytestmark = [CUDA, pytest.mark.sanitize]
DEV_KNOBS = os.environ.get("NITROBREW_DEV_KNOBS") == "1"


def test_every_kernel_once(monkeypatch):
    dev = "cuda"
    cases = itertools.product(
        [torch.bfloat16, torch.float16],
        # (B, N_q, N_k, H, H_ks, H_kt, D_s, D_t): partial tiles, GQA on each side, padded head dims
        # (the last: the teacher's key head changes within a student key head's query heads)
        [(2, 70, 45, 4, 2, 1, 24, 40), (1, 130, 200, 2, 2, 2, 128, 64), (1, 33, 90, 2, 1, 2, 200, 13),
         (1, 300, 260, 4, 1, 4, 64, 72)],
        [False, True],  # causal
        [False, True],  # deterministic
    )
    for dtype, (b, n_q, n_k, h, h_ks, h_kt, d_s, d_t), causal, deterministic in cases:
        q_s = torch.randn(b, n_q, h, d_s, device=dev, dtype=dtype, requires_grad=True)
        k_s = torch.randn(b, n_k, h_ks, d_s, device=dev, dtype=dtype, requires_grad=True)
        q_t = torch.randn(b, n_q, h, d_t, device=dev, dtype=dtype)
        k_t = torch.randn(b, n_k, h_kt, d_t, device=dev, dtype=dtype)
        mask = torch.rand(b, n_k, device=dev) > 0.2
        # dq buffer in one piece / one key head per chunk (a development build's budget switch)
        for chunked in (False, True) if DEV_KNOBS else (False,):
            monkeypatch.setenv("NITROBREW_DQ_ACCUM_BYTES", "1" if chunked else str(256 << 20))
            loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, kind="reverse" if causal else "forward", causal=causal,
                                          attention_mask=mask, temperature=2.0, deterministic=deterministic)
            grads = torch.autograd.grad(loss, (q_s, k_s))
            torch.cuda.synchronize()
            assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
            if deterministic:
                break  # no dq buffer

