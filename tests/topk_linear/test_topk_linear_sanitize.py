"""Runs every CUDA kernel of the top-K loss from hidden states (nitrobrew.topk_kl) once on small,
awkward problems, for compute-sanitizer (memcheck, racecheck):

The GPU runner (tools/gpu/check.sh sanitize) runs these tests under compute-sanitizer, memcheck and
racecheck, on both kernel families:

    compute-sanitizer --tool memcheck python -m pytest -m sanitize tests/topk_linear
"""

import itertools

import pytest
import torch

import nitrobrew
from conftest import CUDA

pytestmark = [CUDA, pytest.mark.sanitize]
# The recompute path's kernels, then the training path's (normalize="full" only; automatic for training
# on CUDA, so the recompute path is asked for by name).
PATHS = pytest.mark.parametrize("grad_in_forward", [False, True])


@PATHS
def test_every_kernel_once(grad_in_forward):
    dev = "cuda"
    cases = itertools.product(
        [torch.bfloat16, torch.float16, torch.float32],  # tensor-core and FMA paths
        # TMA/vectorized loads (several row blocks, tiles, K slabs and backward chunks) / element-wise loads
        [(70, 1700, 24, 9), (300, 1000, 200, 64), (400, 1000, 200, 64), (400, 1500, 328, 64), (5, 131, 13, 3)],
        ["full", "topk"],
    )
    # Blocks that walk several vocabulary tiles (the sm_90a kernels fold one while the next one's
    # product runs), with products long enough to take every piece during them.
    several_tiles = [(torch.bfloat16, (130, 20011, 1100, 16), "full")]
    for dtype, (n, v, d, k), normalize in itertools.chain(cases, several_tiles):
        if dtype == torch.float32 and n in (300, 400):
            continue  # the float32 kernels are the mma.sync ones, covered by the first shape
        if grad_in_forward and normalize == "topk":
            continue  # "topk" has the recompute path only
        xs = torch.randn(n, d, device=dev, dtype=dtype, requires_grad=True)
        ws = torch.randn(v, d, device=dev, dtype=dtype, requires_grad=True)
        ids = torch.randint(0, v, (n, k), device=dev)
        ids[:, -1] = ids[:, 0]  # a repeated id
        lps = torch.log_softmax(torch.randn(n, k, device=dev), -1) - 1.0
        labels = torch.randint(0, v, (n,), device=dev)
        labels[::4] = -100
        loss = nitrobrew.topk_kl(xs, ws, ids, lps, normalize=normalize, labels=labels, temperature=2.0,
                                 chunk_V=700, grad_in_forward=grad_in_forward, grad_chunk_mib=1)
        loss.backward()
        torch.cuda.synchronize()
        assert torch.isfinite(loss) and torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all()



def test_topk_divergences_once():
    # normalize="topk" with each divergence: the logit ops' kernels on the [N, K] float64 rows (K = 1 included),
    # forward and backward, from hidden states and from logits.
    dev = "cuda"
    for (n, v, d, k), (name, weight) in itertools.product(
            [(70, 1700, 24, 9), (5, 131, 13, 1), (33, 1000, 64, 300)],
            [("reverse_kl", {}), ("jsd", {"beta": 0.3}), ("skew_forward_kl", {"alpha": 0.2}),
             ("skew_reverse_kl", {"alpha": 0.7}), ("tvd", {})]):
        xs = torch.randn(n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ws = torch.randn(v, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ids = torch.randint(0, v, (n, k), device=dev)
        ids[:, -1] = ids[:, 0]  # a repeated id
        lps = torch.log_softmax(torch.randn(n, k, device=dev), -1) - 1.0
        labels = torch.randint(0, v, (n,), device=dev)
        labels[::4] = -100
        zs = (xs.detach().float() @ ws.detach().float().T).requires_grad_()
        for loss in (nitrobrew.topk_kl(xs, ws, ids, lps, normalize="topk", divergence=name, labels=labels, **weight),
                     nitrobrew.logits.topk_kl(zs, ids, lps, normalize="topk", divergence=name, labels=labels,
                                              **weight)):
            loss.backward()
        torch.cuda.synchronize()
        assert torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all() and torch.isfinite(zs.grad).all()


@PATHS
def test_bias_and_logit_scale_once(grad_in_forward):
    # The bias read per tile column and per gathered id, and its gradient (the chunk's products for
    # "full", the id runs for "topk").
    dev = "cuda"
    for n, v, d, k in [(400, 1000, 200, 64), (70, 1700, 24, 9)]:
        xs = torch.randn(n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ws = torch.randn(v, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
        bias = torch.randn(v, device=dev, dtype=torch.bfloat16, requires_grad=True)
        ids = torch.randint(0, v, (n, k), device=dev)
        ids[:, -1] = ids[:, 0]  # a repeated id
        lps = torch.log_softmax(torch.randn(n, k, device=dev), -1) - 1.0
        for normalize in ("full",) if grad_in_forward else ("full", "topk"):
            loss = nitrobrew.topk_kl(xs, ws, ids, lps, normalize=normalize, bias_s=bias, logit_scale_s=0.5,
                                     temperature=2.0, grad_in_forward=grad_in_forward, grad_chunk_mib=1)
            loss.backward()
            torch.cuda.synchronize()
            assert torch.isfinite(loss) and torch.isfinite(bias.grad).all() and torch.isfinite(ws.grad).all()


def test_ids_out_of_range_stay_inside_the_weights(monkeypatch):
    # Where the Python check cannot run (torch.compile, CUDA graphs): the guarded ids read no row
    # outside ws, in either normalization's kernels; the rows come out NaN.
    monkeypatch.setattr(nitrobrew._checks, "host_checks_possible", lambda t: False)
    xs = torch.randn(5, 200, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ws = torch.randn(1000, 200, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lps, ids = torch.randn(5, 1000, device="cuda").log_softmax(-1).topk(64, dim=-1)
    ids[1, 3], ids[3, 0] = 1000 + 2**20, -5
    for normalize in ["full", "topk"]:
        loss = nitrobrew.topk_kl(xs, ws, ids, lps, normalize=normalize, reduction="none")
        loss.sum().backward()
        torch.cuda.synchronize()
        assert loss[[1, 3]].isnan().all() and loss[[0, 2, 4]].isfinite().all()
