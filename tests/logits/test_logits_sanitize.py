"""Runs the CUDA kernels of the logit-level losses (KL pass, JSD's mixture pass, gradient) and of
the top-K losses (forward, backward; both normalizations, repeated ids) once on small, awkward
problems.

The GPU runner (tools/gpu/check.sh sanitize) runs these tests under compute-sanitizer, memcheck and
racecheck, on both kernel families:

    compute-sanitizer --tool memcheck python -m pytest -m sanitize tests/logits
"""

import itertools

import pytest
import torch

import nitrobrew
from conftest import CUDA

pytestmark = [CUDA, pytest.mark.sanitize]


def test_every_kernel_once():
    dev = "cuda"
    losses = [nitrobrew.logits.forward_kl, nitrobrew.logits.reverse_kl,
              lambda zs, zt, **kw: nitrobrew.logits.jsd(zs, zt, beta=0.3, **kw),
              lambda zs, zt, **kw: nitrobrew.logits.skew_forward_kl(zs, zt, alpha=0.1, **kw),
              lambda zs, zt, **kw: nitrobrew.logits.skew_reverse_kl(zs, zt, alpha=0.4, **kw), nitrobrew.logits.tvd]
    # V: 16-byte rows for every dtype (vector loads), odd (scalar loads); a strided slice of columns.
    for dtype, v, strided, loss_fn in itertools.product(
            [torch.float32, torch.bfloat16, torch.float16, torch.float64], [1024, 1027], [False, True], losses):
        wide = 2 if strided else 1
        zs = torch.randn(7, v * wide, device=dev, dtype=dtype)
        zt = torch.randn(7, v * wide, device=dev, dtype=dtype)
        zs[:, 10:80] = zt[:, 10:80] = float("-inf")  # masked vocabulary entries (both models: every loss finite)
        zs, zt = zs[:, ::wide].requires_grad_(), zt[:, ::wide]
        labels = torch.tensor([0, -100, 3, 4, -100, 5, 6], device=dev)
        loss = loss_fn(zs, zt, labels=labels, temperature=1.5)
        (grad,) = torch.autograd.grad(loss, zs)
        torch.cuda.synchronize()
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
    for dtype, v, strided, normalize in itertools.product(
            [torch.float32, torch.bfloat16, torch.float64], [1024, 1027], [False, True], ["full", "topk"]):
        wide = 2 if strided else 1
        zs = torch.randn(7, v * wide, device=dev, dtype=dtype)[:, ::wide].requires_grad_()
        lps, ids = torch.randn(7, v, device=dev).log_softmax(-1).topk(300, dim=-1)
        if strided:
            ids[:, 7] = ids[:, 3]  # a repeated id (the sorting path; distinct ids take the other)
        lps[2] = float("-inf")  # a teacher that kept no mass: 0 for "full", NaN for "topk"
        lps[6, 5] = float("nan")  # a NaN row
        labels = torch.tensor([0, -100, 3, 4, -100, 5, 6], device=dev)
        loss = nitrobrew.logits.topk_kl(zs, ids, lps, normalize=normalize, labels=labels, temperature=1.5,
                                        reduction="none")
        (grad,) = torch.autograd.grad(loss[:6].sum(), zs)
        torch.cuda.synchronize()
        clean = [0, 1, 3, 4, 5] if normalize == "topk" else [0, 1, 2, 3, 4, 5]
        assert torch.isfinite(loss[clean]).all() and torch.isfinite(grad[clean]).all() and loss[6].isnan()
    # The top-K kernels' other ways to handle the ids: a vocabulary too large for their bitmap (sorted ids
    # visited after the pass over the row), and K too large to sort (each id compared with the earlier ones).
    for v, k in [(530_000, 40), (5000, 4100)]:
        zs = torch.randn(3, v, device=dev, dtype=torch.bfloat16, requires_grad=True)
        lps, ids = torch.randn(3, v, device=dev).log_softmax(-1).topk(k, dim=-1)
        ids[:, 7] = ids[:, 3]
        for normalize in ["full", "topk"]:
            loss = nitrobrew.logits.topk_kl(zs, ids, lps, normalize=normalize)
            (grad,) = torch.autograd.grad(loss, zs)
            torch.cuda.synchronize()
            assert torch.isfinite(loss) and torch.isfinite(grad).all()



def test_ids_out_of_range_stay_inside_the_row(monkeypatch):
    # Where the Python check cannot run (torch.compile, CUDA graphs): the guarded ids read and write no
    # entry outside their row, in every id path of the kernels; the rows come out NaN.
    monkeypatch.setattr(nitrobrew._checks, "host_checks_possible", lambda t: False)
    for v, k in [(1027, 40), (5000, 4100)]:
        zs = torch.randn(5, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        lps, ids = torch.randn(5, v, device="cuda").log_softmax(-1).topk(k, dim=-1)
        ids[1, 3], ids[3, 0] = v + 2**20, -5
        for normalize in ["full", "topk"]:
            loss = nitrobrew.logits.topk_kl(zs, ids, lps, normalize=normalize, reduction="none")
            loss.sum().backward()
            torch.cuda.synchronize()
            assert loss[[1, 3]].isnan().all() and loss[[0, 2, 4]].isfinite().all()
