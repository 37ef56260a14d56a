"""The two CUDA kernel families (mma.sync for sm_80, TMA + wgmma for sm_90a): which one runs,
and both against the float64 reference on shapes that exercise their tiling (several row
blocks, vocabulary tiles, K slabs and block groups, none of them whole)."""

import itertools
import re

import pytest
import torch

import nitrobrew
from conftest import CUDA, DEV_BUILD
from helpers import check_against_reference, make_biases, make_problem

pytestmark = CUDA

BETAS = [0.0, 1.0, 0.5]


def is_hopper():
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["auto", "sm80"])
def kernel_family(request, monkeypatch):
    """Runs a test with the kernels the library picks, then with the sm_80 ones forced."""
    if request.param == "sm80":
        monkeypatch.setenv("NITROBREW_FORCE_SM80", "1")
    else:
        monkeypatch.delenv("NITROBREW_FORCE_SM80", raising=False)
    return request.param


def launched_kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def run_loss(xs, xt, ws, wt, grad_in_forward=False):
    """A JSD training step, on the recompute path unless told otherwise."""
    xs = xs.detach().requires_grad_()
    ws = ws.detach().requires_grad_()
    nitrobrew.jsd(xs, xt, ws, wt, beta=0.5, grad_in_forward=grad_in_forward).backward()


@pytest.mark.parametrize("d_s", [64, 61])
def test_kernel_family_selection(kernel_family, d_s):
    # bf16 rows of 64 values are TMA-addressable; 61 values (122 bytes) are not.
    xs, xt, ws, wt, _ = make_problem(n=200, v=300, d_s=d_s, d_t=64, dtype=torch.bfloat16, device="cuda")
    names = launched_kernels(lambda: run_loss(xs, xt, ws, wt))
    hopper = sum("hopper_logit_kernel" in n for n in names)
    mma = sum("mma_logit_kernel" in n for n in names)
    if kernel_family == "auto" and is_hopper() and d_s % 8 == 0:
        assert hopper == 3 and mma == 0, names  # KL pass, mixture pass, gradient pass
    else:
        assert hopper == 0 and mma == 3, names


@pytest.mark.parametrize("n,cluster", [(200, 2), (300, 1), (400, 2)])
def test_sm90a_blocks_pair_up_when_row_blocks_do(n, cluster):
    # An even number of 128-row blocks runs in clusters of 2 that share each W slab; an odd one
    # unpaired. Both give the same results, so only the launched instantiation tells them apart.
    if not is_hopper():
        pytest.skip("the sm_90a kernels run on Hopper only")
    xs, xt, ws, wt, _ = make_problem(n=n, v=300, d_s=64, d_t=64, dtype=torch.bfloat16, device="cuda")
    names = [name for name in launched_kernels(lambda: run_loss(xs, xt, ws, wt)) if "hopper_logit_kernel" in name]
    clusters = [re.search(r"hopper_logit_kernel<.*, (\d+)>\(", name) for name in names]
    assert len(names) == 3 and all(clusters), names
    assert [int(c.group(1)) for c in clusters] == [cluster] * 3, names


@pytest.mark.parametrize("n", [300, 400])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "beta,masked,ce_weight,softcap,padded",
    list(itertools.product(BETAS, [False, True], [0.0, 0.5], [False, True], [False, True])),
)
def test_tensor_core_kernels_every_option(kernel_family, n, dtype, beta, masked, ce_weight, softcap, padded):
    # 300 rows = 2 x 128 + 44 (4 x 64 + 44): 3 row blocks, which the sm_90a kernel runs unpaired;
    # 400 rows = 3 x 128 + 16: 4 row blocks, run in clusters of 2 that share the W slabs.
    # V = 1000 = 3 x 256 + 232 (15 x 64 + 40); K = 200 and 136: 7 and 5 slabs of 32 (4 and 3 of
    # 64), the last partial.
    rows = 1030 if padded else None
    xs, xt, ws, wt, labels = make_problem(n=n, v=1000, d_s=200, d_t=136, dtype=dtype, device="cuda",
                                          masked=masked, rows_s=rows, rows_t=rows)
    options = dict(reduction="none", labels=labels if masked or ce_weight else None, ce_weight=ce_weight,
                   temperature=1.5, vocab_size=1000 if padded else None)
    if softcap:
        options.update(softcap_s=4.0, softcap_t=6.0)
    check_against_reference(xs, xt, ws, wt, beta=beta, **options)


@pytest.mark.parametrize("n", [300, 400])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("model", ["bias", "scale_softcap", "student_bias_scale"])
@pytest.mark.parametrize("ce_weight,padded", [(0.0, False), (0.5, True)])
def test_tensor_core_kernels_bias_and_logit_scale(kernel_family, n, beta, model, ce_weight, padded):
    # The biases are read per fragment column of each tile, the last tile partial (V = 1000), past
    # which the padded rows' biases (1030 rows) must not reach the loss.
    rows = 1030 if padded else None
    xs, xt, ws, wt, labels = make_problem(n=n, v=1000, d_s=200, d_t=136, dtype=torch.bfloat16, device="cuda",
                                          masked=True, rows_s=rows, rows_t=rows)
    bias_s, bias_t = make_biases(ws, wt, scale=2.0)
    options = {
        "bias": dict(bias_s=bias_s, bias_t=bias_t),
        "scale_softcap": dict(logit_scale_s=0.0625, logit_scale_t=2.5, softcap_s=4.0, softcap_t=6.0),
        "student_bias_scale": dict(bias_s=bias_s, logit_scale_s=0.5),
    }[model]
    check_against_reference(xs, xt, ws, wt, beta=beta, reduction="none", labels=labels, ce_weight=ce_weight,
                            temperature=1.5, vocab_size=1000 if padded else None, **options)


@pytest.mark.parametrize("n", [1100, 1200])
@pytest.mark.parametrize("beta", BETAS)
def test_tensor_core_kernels_many_row_blocks(kernel_family, n, beta):
    # 1100 rows: 9 row blocks of 128 (unpaired), 1200: 10 (5 clusters of 2), so the sm_90a block
    # order's second group is partial either way.
    xs, xt, ws, wt, labels = make_problem(n=n, v=700, d_s=72, d_t=48, dtype=torch.bfloat16, device="cuda",
                                          masked=True)
    check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, reduction="none")


@pytest.mark.parametrize("n", [300, 400])
@pytest.mark.parametrize("beta", BETAS)
def test_tensor_core_kernels_long_products(kernel_family, n, beta):
    # K = 620 and 330: 20 and 11 slabs of 32 (the last partial), more than a ring holds, so each
    # product reuses its stages; ~80 vocabulary tiles over a few splits, so the ring's state carries
    # across tiles. 300 rows run unpaired on sm_90a, 400 in clusters of 2.
    xs, xt, ws, wt, labels = make_problem(n=n, v=20011, d_s=330, d_t=620, dtype=torch.bfloat16, device="cuda",
                                          masked=True)
    check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, ce_weight=0.3, softcap_t=20.0,
                            reduction="none")


@pytest.mark.parametrize("d_t", [300, 700, 1100])
@pytest.mark.parametrize("beta", BETAS)
def test_tensor_core_kernels_student_side_during_teacher_product(kernel_family, d_t, beta):
    # Without the CE add-on, the sm_90a KL pass folds the student's side of each whole tile of forward
    # KL and JSD (beta 0 and 0.5) while the teacher's product runs, one of 33 pieces per teacher slab
    # of 32: K = 1100 (35 slabs) takes all of them during the product, 700 (22) and 300 (10) leave
    # some for after it. The vocabulary's last tile is partial (the general fold); reverse KL (beta 1)
    # folds as before.
    xs, xt, ws, wt, labels = make_problem(n=260, v=3001, d_s=96, d_t=d_t, dtype=torch.bfloat16, device="cuda",
                                          masked=True)
    check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, reduction="none")


@pytest.mark.parametrize("temperature", [0.1, 10.0])
def test_tensor_core_kernels_temperatures_and_large_logits(kernel_family, temperature):
    xs, xt, ws, wt, labels = make_problem(n=150, v=500, d_s=64, d_t=128, dtype=torch.bfloat16, device="cuda",
                                          scale=30.0, masked=True)
    check_against_reference(xs, xt, ws, wt, beta=0.0, temperature=temperature, labels=labels, reduction="sum")


@pytest.mark.parametrize("beta", BETAS)
def test_tensor_core_kernels_several_tiles_per_block(kernel_family, beta):
    # One row block and ~200 vocabulary tiles: more tiles than SMs, so each block walks several
    # (the ring, the parked student tile and the per-row state carry across tiles).
    xs, xt, ws, wt, labels = make_problem(n=100, v=51237, d_s=40, d_t=24, dtype=torch.bfloat16, device="cuda",
                                          masked=True)
    check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, ce_weight=0.2, reduction="none")


@DEV_BUILD
@pytest.mark.parametrize("n,v,cols,chunks", [(300, 3001, "768", 4), (400, 20011, "9984", 3)])
@pytest.mark.parametrize("beta", BETAS)
def test_tensor_core_kernels_backward_in_chunks(kernel_family, monkeypatch, n, v, cols, chunks, beta):
    # The backward's vocabulary chunks, forced narrow (a development build's switch), each a
    # gradient-pass launch whose dLoss/dz cuBLAS adds into dxs and dws: V = 3001 in 4 chunks of 768
    # (the last 697 wide, its last tile partial), and V = 20011 in 2 of 9984 (39 tiles of 256 on
    # sm_90a, 156 of 64 on sm_80; 2 per block either way) and one of 43.
    monkeypatch.setenv("NITROBREW_GRAD_CHUNK_COLS", cols)
    xs, xt, ws, wt, labels = make_problem(n=n, v=v, d_s=72, d_t=104, dtype=torch.bfloat16, device="cuda",
                                          masked=True)
    names = launched_kernels(lambda: run_loss(xs, xt, ws, wt))
    assert sum("GradPass" in name for name in names) == chunks, names
    bias_s, _ = make_biases(ws, wt, scale=2.0)
    check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, ce_weight=0.2, bias_s=bias_s, reduction="none")


def test_sm90a_backward_chunks_fill_whole_waves(monkeypatch):
    # The automatic chunk width (VocabWalk::grad_chunk_cols): at N = 8192 on 132 SMs the 192 MiB
    # budget allows 12288 columns (13 launches, each ending in a partial wave); 8448 (33 tiles of
    # 256; 64 row blocks x 33 = 16 whole waves) divides V = 152064 exactly, so 18 launches.
    if not is_hopper() or torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the widths are worked out for the sm_90a kernels on 132 SMs")
    monkeypatch.delenv("NITROBREW_FORCE_SM80", raising=False)
    monkeypatch.delenv("NITROBREW_GRAD_CHUNK_COLS", raising=False)
    xs, xt, ws, wt, _ = make_problem(n=8192, v=152064, d_s=64, d_t=64, dtype=torch.bfloat16, device="cuda")
    names = launched_kernels(lambda: run_loss(xs, xt, ws, wt))
    assert sum("GradPass" in name for name in names) == 18, names


def test_tensor_core_kernels_non_contiguous_rows(kernel_family):
    # Row strides larger than the row (slices of wider matrices) stay on the fast path when aligned;
    # the padding is NaN, so reading it (a wrong stride or extent) would show.
    xs, xt, ws, wt, labels = make_problem(n=130, v=400, d_s=80, d_t=96, dtype=torch.bfloat16, device="cuda")
    wide = lambda t: torch.cat([t, torch.full_like(t[:, :16], float("nan"))], dim=1)[:, : t.shape[1]]
    xs, ws = wide(xs), wide(ws)
    assert not xs.is_contiguous() and not ws.is_contiguous()
    check_against_reference(xs, xt, ws, wt, beta=1.0, reduction="mean")


# ------------------------------------------------------------------------------ training path -----
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(
    "beta,masked,ce_weight,softcap,padded",
    [(beta, *rest) for beta in BETAS for rest in [(False, 0.0, False, False), (True, 0.5, True, True),
                                                    (True, 0.0, False, True), (False, 0.5, True, False)]],
)
def test_training_path_every_option(kernel_family, dtype, reduction, beta, masked, ce_weight, softcap, padded):
    # The gradients formed in the forward: 300 rows under a 1 MiB budget run in two chunks of dLoss/dz
    # (195 + 105 rows) of 65-row steps of products (the last partial); V = 1001 divides no vector of 4,
    # and padded weights (1030 rows) must not reach the loss or get a gradient.
    rows = 1030 if padded else None
    xs, xt, ws, wt, labels = make_problem(n=300, v=1001, d_s=200, d_t=136, dtype=dtype, device="cuda",
                                          masked=masked, rows_s=rows, rows_t=rows)
    bias_s, bias_t = make_biases(ws, wt, scale=2.0)
    options = dict(reduction=reduction, labels=labels if masked or ce_weight else None, ce_weight=ce_weight,
                   temperature=1.5, vocab_size=1001 if padded else None, bias_s=bias_s, bias_t=bias_t,
                   logit_scale_s=0.5 if padded else 1.0)
    if softcap:
        options.update(softcap_s=4.0, softcap_t=6.0)
    check_against_reference(xs, xt, ws, wt, beta=beta, grad_in_forward=True, grad_chunk_mib=1, **options)


@pytest.mark.parametrize("slice_cols", [None, pytest.param("1000", marks=DEV_BUILD), pytest.param("200", marks=DEV_BUILD)])
@pytest.mark.parametrize("v", [3001, 5001, 12001, 40009, 152067])
@pytest.mark.parametrize("beta", BETAS)
def test_training_path_row_slices(kernel_family, monkeypatch, slice_cols, v, beta):
    # The row kernels cut each row into slices of equal width, a block each, merged per row in order: at
    # most the default width (one to ten slices here), and (development builds) 1000 or 200 columns, up to
    # 761 slices a row. Masked rows, the CE add-on's label in any slice, a bias.
    if slice_cols is not None:
        monkeypatch.setenv("NITROBREW_ROW_SLICE_COLS", slice_cols)
    xs, xt, ws, wt, labels = make_problem(n=97, v=v, d_s=64, d_t=48, dtype=torch.bfloat16, device="cuda",
                                          masked=True)
    bias_s, _ = make_biases(ws, wt, scale=2.0)
    check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, ce_weight=0.3, bias_s=bias_s,
                            reduction="mean", grad_in_forward=True)
    names = launched_kernels(lambda: run_loss(xs, xt, ws, wt, grad_in_forward=True))
    assert sum("row_grads_kernel" in name for name in names) == 1, names
    assert not any("hopper_logit_kernel" in name or "mma_logit_kernel" in name for name in names), names


@pytest.mark.parametrize("temperature,scale", [(0.1, 3.0), (10.0, 3.0), (1.0, 3000.0)])
@pytest.mark.parametrize("beta", BETAS)
def test_training_path_extreme_temperatures_and_logits(kernel_family, temperature, scale, beta):
    xs, xt, ws, wt, labels = make_problem(n=150, v=4999, d_s=64, d_t=128, dtype=torch.bfloat16, device="cuda",
                                          scale=scale, masked=True)
    check_against_reference(xs, xt, ws, wt, beta=beta, temperature=temperature, labels=labels, ce_weight=0.1,
                            reduction="sum", grad_in_forward=True)


def test_training_path_launches_by_chunk():
    # 1000 rows, V = 20011, 8 MiB: steps of products of 26 rows (2 x 4 x 20016 bytes each), chunks of
    # dLoss/dz as long as the rest allows; every step is two products and one launch of each row kernel.
    xs, xt, ws, wt, labels = make_problem(n=1000, v=20011, d_s=64, d_t=64, dtype=torch.bfloat16, device="cuda",
                                          masked=True)
    from nitrobrew._forward_grads import plan_chunks

    plan = plan_chunks(1000, 20011, product_bytes=8, grad_bytes=2, budget=8 << 20)
    steps = sum(-(-min(plan.grad_rows, 1000 - b0) // plan.product_rows) for b0 in range(0, 1000, plan.grad_rows))
    assert steps > 1 and plan.grad_rows < 1000, plan
    xs_ = xs.detach().requires_grad_()
    names = launched_kernels(lambda: nitrobrew.forward_kl(xs_, xt, ws, wt, labels=labels, grad_in_forward=True,
                                                          grad_chunk_mib=8).backward())
    assert sum("row_grads_kernel" in name for name in names) == steps, names
