"""Runs every CUDA kernel of the attention KL once on small, awkward problems, for compute-sanitizer:
on Hopper the TMA + wgmma forward and backwards (head dims up to 128: the fused backward with its
dq buffer, also chunked, and the deterministic dq kernel with the fused kernel's dk alone) and the mma.sync kernels for
larger head dims; with NITROBREW_FORCE_SM80=1 the mma.sync forward, dk with atomic dq (also
chunked), and dq and dk of the deterministic backward. Also layout="bhnd" inputs, which every kernel
family reads in place at their own strides (the TMA maps and the cp.async rows), and float32 inputs,
which take the chunked ATen path (cuBLAS and ATen's kernels).

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
from helpers import force_sm80

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



def test_bhnd_inputs_once(monkeypatch):
    # [B, H, N, D] tensors read in place: contiguous ones, and the teacher's queries cut out of a packed
    # [B, H, N, 2 D] projection (row stride 2 D); partial tiles, GQA on both sides.
    dev, dtype = "cuda", torch.bfloat16
    for forced, causal, deterministic in itertools.product([False, True], [False, True], [False, True]):
        force_sm80(monkeypatch, forced)
        q_s = torch.randn(2, 4, 70, 64, device=dev, dtype=dtype, requires_grad=True)
        k_s = torch.randn(2, 2, 45, 64, device=dev, dtype=dtype, requires_grad=True)
        q_t = torch.randn(2, 4, 70, 2 * 48, device=dev, dtype=dtype)[..., :48]
        k_t = torch.randn(2, 1, 45, 48, device=dev, dtype=dtype)
        mask = torch.rand(2, 45, device=dev) > 0.2
        loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, kind="reverse" if causal else "forward", causal=causal,
                                      attention_mask=mask, deterministic=deterministic, layout="bhnd")
        grads = torch.autograd.grad(loss, (q_s, k_s))
        torch.cuda.synchronize()
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)


def test_float32_inputs_once():
    # The chunked path: blocks of rows against all keys, causal (skipped blocks), key mask, GQA, head dims
    # that are not multiples of 8; [B, N, H, D] and [B, H, N, D] inputs.
    dev = "cuda"
    for causal, layout in itertools.product([False, True], ["bnhd", "bhnd"]):
        shape = (lambda b, n, h, d: (b, n, h, d)) if layout == "bnhd" else (lambda b, n, h, d: (b, h, n, d))
        q_s = torch.randn(*shape(2, 70, 4, 20), device=dev, requires_grad=True)
        k_s = torch.randn(*shape(2, 45, 2, 20), device=dev, requires_grad=True)
        q_t = torch.randn(*shape(2, 70, 4, 13), device=dev)
        k_t = torch.randn(*shape(2, 45, 1, 13), device=dev)
        mask = torch.rand(2, 45, device=dev) > 0.2
        loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, kind="reverse", causal=causal, attention_mask=mask,
                                      layout=layout)
        grads = torch.autograd.grad(loss, (q_s, k_s))
        torch.cuda.synchronize()
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
