"""Runs every CUDA kernel of the fused-linear losses once on small, awkward problems.

The GPU runner (tools/gpu/check.sh sanitize) runs these tests under compute-sanitizer, memcheck and
racecheck, on both kernel families:

    compute-sanitizer --tool memcheck python -m pytest -m sanitize tests/fused_linear
"""

import itertools

import pytest
import torch

import nitrobrew
from conftest import CUDA, DEV_BUILD

pytestmark = [CUDA, pytest.mark.sanitize]


def _problem(n, v, d_s, d_t, dtype):
    """Random inputs on the GPU, the weights padded past v (3 and 5 rows), every fourth row masked."""
    dev = "cuda"
    xs = torch.randn(n, d_s, device=dev, dtype=dtype, requires_grad=True)
    xt = torch.randn(n, d_t, device=dev, dtype=dtype)
    ws = torch.randn(v + 3, d_s, device=dev, dtype=dtype, requires_grad=True)
    wt = torch.randn(v + 5, d_t, device=dev, dtype=dtype)
    labels = torch.randint(0, v, (n,), device=dev)
    labels[::4] = -100
    return xs, xt, ws, wt, labels


# The recompute path (the vocabulary walk's passes and the chunked backward), then the training path
# (cuBLAS products and the row kernels over slices of rows).
PATHS = pytest.mark.parametrize("grad_in_forward", [False, True])


@PATHS
def test_every_kernel_once(grad_in_forward):
    cases = itertools.product(
        [torch.bfloat16, torch.float16, torch.float32],  # tensor-core and FMA paths
        # TMA/vectorized loads (several row blocks, tiles and K slabs; 400 rows: sm_90a blocks in
        # clusters of 2; K = 330 / 620: products longer than the ring) / element-wise loads
        [(70, 200, 24, 40), (300, 1000, 200, 136), (400, 1000, 200, 136), (400, 1500, 330, 620), (5, 131, 13, 7)],
        [0.0, 1.0, 0.5],
        [0.5],
    )
    # Without the CE add-on the sm_90a KL pass folds the student's side while the teacher's product
    # runs (K = 1100: all 33 pieces during the product; 620: some after it).
    no_ce = itertools.product([torch.bfloat16], [(400, 1500, 330, 1100), (300, 1000, 200, 620)], [0.0, 0.5], [0.0])
    for dtype, (n, v, d_s, d_t), beta, ce_weight in itertools.chain(cases, no_ce):
        if dtype == torch.float32 and n in (300, 400):
            continue  # the float32 kernels are the mma.sync ones, covered by the first shape
        xs, xt, ws, wt, labels = _problem(n, v, d_s, d_t, dtype)
        loss = nitrobrew.jsd(xs, xt, ws, wt, beta=beta, labels=labels, ce_weight=ce_weight, softcap_s=20.0,
                             softcap_t=30.0, vocab_size=v, temperature=2.0, grad_in_forward=grad_in_forward,
                             grad_chunk_mib=1)
        loss.backward()
        torch.cuda.synchronize()
        assert torch.isfinite(loss) and torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all()



@PATHS
def test_second_pass_divergences_once(grad_in_forward):
    # The skew KLs and TVD: their second pass's and gradient folds (the vocabulary walk's on both kernel families,
    # the training path's row kernels, each compiled per divergence), with and without the CE add-on.
    for dtype, (n, v, d_s, d_t) in [(torch.bfloat16, (400, 1500, 330, 620)), (torch.bfloat16, (5, 131, 13, 7)),
                                    (torch.float32, (70, 200, 24, 40))]:
        xs, xt, ws, wt, labels = _problem(n, v, d_s, d_t, dtype)
        for name, weight, ce_weight in [("skew_forward_kl", {"alpha": 0.1}, 0.5), ("skew_reverse_kl", {"alpha": 0.5}, 0.0),
                                        ("tvd", {}, 0.5)]:
            loss = getattr(nitrobrew, name)(xs, xt, ws, wt, **weight, labels=labels, ce_weight=ce_weight,
                                            softcap_s=20.0, vocab_size=v, temperature=2.0,
                                            grad_in_forward=grad_in_forward, grad_chunk_mib=1)
            loss.backward()
            torch.cuda.synchronize()
            assert torch.isfinite(loss) and torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all()
            xs.grad = ws.grad = None


@PATHS
def test_entropy_once(grad_in_forward):
    # return_entropy: the general fold of every tile (quad merges of the entropy state; sm_90a's and sm_80's KL
    # pass) and the training path's partials variant that folds it; both divergence directions.
    for dtype, (n, v, d_s, d_t) in [(torch.bfloat16, (400, 1500, 330, 620)), (torch.float32, (70, 200, 24, 40))]:
        xs, xt, ws, wt, labels = _problem(n, v, d_s, d_t, dtype)
        for beta in (0.0, 1.0):
            loss, entropy = nitrobrew.jsd(xs, xt, ws, wt, beta=beta, labels=labels, vocab_size=v, temperature=2.0,
                                          grad_in_forward=grad_in_forward, grad_chunk_mib=1, return_entropy=True)
            loss.backward()
            torch.cuda.synchronize()
            assert torch.isfinite(loss) and torch.isfinite(entropy).all() and (entropy[::4] == 0).all()


@PATHS
def test_bias_and_logit_scale_once(grad_in_forward):
    # The lm_head biases are read at each tile's columns (the last tile partial, V = 1000 of 1003 /
    # 1005 rows), and the backward's bias gradient reads the chunk: both kernel families via the runner.
    dev = "cuda"
    for n, v, d_s, d_t in [(400, 1000, 200, 136), (70, 200, 24, 40)]:
        xs = torch.randn(n, d_s, device=dev, dtype=torch.bfloat16, requires_grad=True)
        xt = torch.randn(n, d_t, device=dev, dtype=torch.bfloat16)
        ws = torch.randn(v + 3, d_s, device=dev, dtype=torch.bfloat16, requires_grad=True)
        wt = torch.randn(v + 5, d_t, device=dev, dtype=torch.bfloat16)
        bias_s = torch.randn(v + 3, device=dev, dtype=torch.bfloat16, requires_grad=True)
        bias_t = torch.randn(v + 5, device=dev, dtype=torch.bfloat16)
        for beta in (0.0, 0.5):
            loss = nitrobrew.jsd(xs, xt, ws, wt, beta=beta, bias_s=bias_s, bias_t=bias_t, logit_scale_s=0.5,
                                 logit_scale_t=1.5, softcap_s=20.0, vocab_size=v, temperature=2.0,
                                 grad_in_forward=grad_in_forward)
            loss.backward()
            torch.cuda.synchronize()
            assert torch.isfinite(loss) and torch.isfinite(bias_s.grad).all() and torch.isfinite(ws.grad).all()


@pytest.mark.parametrize("slice_cols", [None, pytest.param("1000", marks=DEV_BUILD)])
def test_training_path_row_slices_once(monkeypatch, slice_cols):
    # The row kernels over slices of rows, the default width and (development builds) 1000 columns, the
    # last slice short: masked rows, the CE add-on, and JSD's mixture launch.
    if slice_cols is not None:
        monkeypatch.setenv("NITROBREW_ROW_SLICE_COLS", slice_cols)
    for v, dtype in [(3001, torch.bfloat16), (5001, torch.bfloat16), (152067, torch.bfloat16),
                     (40009, torch.float16)]:
        xs = torch.randn(37, 64, device="cuda", dtype=dtype, requires_grad=True)
        xt = torch.randn(37, 48, device="cuda", dtype=dtype)
        ws, wt = torch.randn(v, 64, device="cuda", dtype=dtype) / 8, torch.randn(v, 48, device="cuda", dtype=dtype) / 7
        ws.requires_grad_()
        labels = torch.randint(0, v, (37,), device="cuda")
        labels[::5] = -100
        for beta in (0.0, 1.0, 0.5):
            loss = nitrobrew.jsd(xs, xt, ws, wt, beta=beta, labels=labels, ce_weight=0.2, grad_in_forward=True)
            loss.backward()
            torch.cuda.synchronize()
            assert torch.isfinite(loss) and torch.isfinite(xs.grad).all() and torch.isfinite(ws.grad).all()



def _labels_out_of_range(monkeypatch):
    """Where the Python check cannot run (torch.compile, CUDA graphs): rows 1 and 4 have labels outside
    [0, V)."""
    monkeypatch.setattr(nitrobrew._checks, "host_checks_possible", lambda t: False)
    xs = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xt = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    ws, wt = (torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16) / 8 for _ in range(2))
    return xs, xt, ws, wt, torch.tensor([1, 5000, 3, -100, -7, 9], device="cuda")


def test_labels_out_of_range_with_cross_entropy(monkeypatch):
    # Such a label makes its row NaN instead of stopping the merge kernel with a device-side assertion.
    xs, xt, ws, wt, labels = _labels_out_of_range(monkeypatch)
    for loss_fn in [nitrobrew.forward_kl, lambda *a, **kw: nitrobrew.jsd(*a, beta=0.5, **kw)]:
        loss = loss_fn(xs, xt, ws, wt, labels=labels, ce_weight=0.3, reduction="none")
        loss.sum().backward()
        torch.cuda.synchronize()
        assert loss[[1, 4]].isnan().all() and loss[[0, 2, 3, 5]].isfinite().all()


def test_labels_out_of_range_on_the_training_path(monkeypatch):
    # The same on the training path: the bad rows' dLoss/dz is NaN, so the loss is NaN, those rows of
    # xs.grad too, and no device-side assertion ends the process.
    xs, xt, ws, wt, labels = _labels_out_of_range(monkeypatch)
    loss = nitrobrew.jsd(xs, xt, ws, wt, beta=0.5, labels=labels, ce_weight=0.3, reduction="sum", grad_in_forward=True)
    loss.backward()
    torch.cuda.synchronize()
    assert loss.isnan() and xs.grad[[1, 4]].isnan().all() and xs.grad[[0, 2, 3, 5]].isfinite().all()
