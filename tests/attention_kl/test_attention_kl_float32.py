"""float32 attention KL through the chunked ATen path (csrc/attention_kl/attention_kl_chunked.*), which CUDA
runs for float32 inputs: values and gradients against the float64 reference, to float32's precision.

On the CPU (and CUDA) through the test-only ops _attention_kl_chunked_fwd / _bwd, whose block budget
is an argument, so that small problems take several blocks (of rows, or of whole batches); on CUDA also
through nitrobrew.attention_kl for every option. TF32 stays off inside the call even where the user
allowed it, and the setting is put back; blocks bound the memory."""

import itertools

import pytest
import torch

import nitrobrew
from conftest import CUDA, DEVICES
from helpers import (GQA, KINDS, assert_close_to_oracle, assert_compiled_gradients_match, attention_values_and_grads,
                     check_attention, make_attention)
from nitrobrew import reference

ops = torch.ops.nitrobrew
DIVERGENCES = {"forward": "forward_kl", "reverse": "reverse_kl"}


def chunked(q_s, k_s, q_t, k_t, *, budget, kind="forward", causal=False, attention_mask=None, temperature=1.0,
            scale_s=None, scale_t=None, reduction="none"):
    """The chunked ops as a function of the reference's signature (reduction "none"), with the
    backward run by a custom autograd function, so that attention_values_and_grads can drive it."""
    assert reduction == "none"
    scale_s = q_s.shape[-1] ** -0.5 if scale_s is None else scale_s
    scale_t = q_t.shape[-1] ** -0.5 if scale_t is None else scale_t
    options = (DIVERGENCES[kind], causal, scale_s, scale_t, temperature, budget)
    return _Chunked.apply(q_s, k_s, q_t, k_t, attention_mask, options)


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_s, k_s, q_t, k_t, mask, options):
        loss, row_stats = ops._attention_kl_chunked_fwd(q_s, k_s, q_t, k_t, mask, *options)
        ctx.save_for_backward(q_s, k_s, q_t, k_t, row_stats)
        ctx.mask, ctx.options = mask, options
        return loss

    @staticmethod
    def backward(ctx, grad):
        q_s, k_s, q_t, k_t, row_stats = ctx.saved_tensors
        dq, dk = ops._attention_kl_chunked_bwd(grad, q_s, k_s, q_t, k_t, ctx.mask, row_stats, *ctx.options)
        return dq, dk, None, None, None, None


def check_chunked(q_s, k_s, q_t, k_t, *, budget, **options):
    """The chunked ops vs the float64 oracle, within 2x the error of the float32 reference."""
    upstream = torch.randn((q_s.shape[0], q_s.shape[2], q_s.shape[1]), dtype=torch.float64).to(q_s.device)
    ours = attention_values_and_grads(lambda *t, **o: chunked(*t, budget=budget, **o), q_s, k_s, q_t, k_t,
                                      upstream, reduction="none", **options)
    oracle = attention_values_and_grads(reference.attention_kl, q_s, k_s, q_t, k_t, upstream, reduction="none",
                                        dtype=torch.float64, **options)
    same = attention_values_and_grads(reference.attention_kl, q_s, k_s, q_t, k_t, upstream, reduction="none",
                                      dtype=q_s.dtype, **options)
    assert ours[0].dtype == q_s.dtype and ours[1].dtype == q_s.dtype and ours[2].dtype == k_s.dtype
    for name, a, o, s in zip(("loss", "dq_s", "dk_s"), ours, oracle, same):
        assert_close_to_oracle(a, o, s, k=2.0, rel_floor=1e-6, what=name)
    return ours


# Budgets: one row per block; 10 rows; whole batches (2 per block); everything in one block.
# A row of one batch is 4 heads x 45 keys x 4 bytes = 720 bytes.
BUDGETS = [1, 7200, 2 * 37 * 720, 1 << 30]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("kind,causal,masked,gqa", list(itertools.product(KINDS, [False, True], [False, True],
                                                                         list(GQA))))
def test_chunked_ops_every_option(device, budget, kind, causal, masked, gqa):
    # 3 batches, 37 queries, 45 keys (no block size divides them); head dims 24 and 40.
    q_s, k_s, q_t, k_t, mask = make_attention(b=3, gqa=gqa, masked=masked, device=device)
    check_chunked(q_s, k_s, q_t, k_t, budget=budget, kind=kind, causal=causal, attention_mask=mask,
                  temperature=1.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_q,n_k", [(300, 70), (70, 300)])
def test_chunked_ops_causal_alignment(device, kind, n_q, n_k):
    # 300 queries and 70 keys: the first 230 rows see no key, and the first blocks are skipped whole.
    q_s, k_s, q_t, k_t, mask = make_attention(b=1, n_q=n_q, n_k=n_k, heads=2, d_s=16, d_t=8, masked=True,
                                              device=device)
    check_chunked(q_s, k_s, q_t, k_t, budget=2 * n_k * 4 * 16, kind=kind, causal=True, attention_mask=mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature,scale", [(0.1, 1.0), (10.0, 1.0), (1.0, 30.0)])
def test_chunked_ops_temperatures_and_large_scores(device, kind, temperature, scale):
    q_s, k_s, q_t, k_t, mask = make_attention(gqa="both", masked=True, scale=scale, device=device)
    check_chunked(q_s, k_s, q_t, k_t, budget=7200, kind=kind, causal=True, attention_mask=mask,
                  temperature=temperature)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_ops_rows_that_see_no_key(device):
    q_s, k_s, q_t, k_t, _ = make_attention(b=2, n_q=9, n_k=5, heads=2, d_s=8, d_t=8, device=device)
    mask = torch.ones(2, 5, dtype=torch.bool, device=device)
    mask[1] = False  # batch 1 attends to nothing
    loss, stats = ops._attention_kl_chunked_fwd(q_s, k_s, q_t, k_t, mask, "reverse_kl", True, 0.5, 0.5, 1.0, 64)
    # Query i sees keys j <= i - 4: rows 0-3 see none.
    assert (loss[:, :, :4] == 0).all() and (loss[1] == 0).all() and (stats[1] == 0).all()
    assert (stats[:, :, :4] == 0).all() and (loss[0, :, 5:] > 0).all()
    dq, dk = ops._attention_kl_chunked_bwd(torch.ones_like(loss), q_s, k_s, q_t, k_t, mask, stats, "reverse_kl",
                                           True, 0.5, 0.5, 1.0, 64)
    assert (dq[:, :4] == 0).all() and (dq[1] == 0).all() and (dk[1] == 0).all()
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and (dq[0, 5:] != 0).any()


def values_under_precision(precision, fn, *args, **options):
    """attention_values_and_grads(fn, ...) under set_float32_matmul_precision(precision), checking that the
    setting is the user's again after the call; the caller's setting is restored at the end."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        values = attention_values_and_grads(fn, *args, **options)
        assert torch.get_float32_matmul_precision() == precision, "the op did not put the user's setting back"
    finally:
        torch.set_float32_matmul_precision(before)
    return values


def check_exact_under_precision(precision, fn, q_s, k_s, q_t, k_t, **options):
    """fn's values and gradients, computed under `precision`, against references computed without
    reduced-precision matmuls."""
    upstream = torch.randn(q_s.shape[0], q_s.shape[2], q_s.shape[1], dtype=torch.float64).to(q_s.device)
    options = dict(reduction="none", **options)
    ours = values_under_precision(precision, fn, q_s, k_s, q_t, k_t, upstream, **options)
    oracle = attention_values_and_grads(reference.attention_kl, q_s, k_s, q_t, k_t, upstream, dtype=torch.float64,
                                        **options)
    same = attention_values_and_grads(reference.attention_kl, q_s, k_s, q_t, k_t, upstream, dtype=torch.float32,
                                      **options)
    for name, a, o, s in zip(("loss", "dq_s", "dk_s"), ours, oracle, same):
        assert_close_to_oracle(a, o, s, k=2.0, rel_floor=1e-6, what=name)


@pytest.mark.parametrize("precision", ["high", "medium"])
def test_chunked_ops_are_exact_under_reduced_matmul_precision(precision):
    # The ops switch reduced-precision float32 matmuls off for the call (on CPUs that have them: oneDNN's
    # TF32 / bfloat16 under "high" / "medium") and put the user's setting back afterwards.
    q_s, k_s, q_t, k_t, mask = make_attention(gqa="student", masked=True, scale=6.0)
    check_exact_under_precision(precision, lambda *t, **o: chunked(*t, budget=7200, **o), q_s, k_s, q_t, k_t,
                                kind="reverse", causal=True, attention_mask=mask)


def test_chunked_ops_allocate_blocks_within_the_budget():
    # 1024 x 1024 scores of 2 heads: 8 MiB per model. With a 256 KiB budget per block (32 rows), no
    # allocation may exceed the budget (the keys' copy, dq and dk are 64 KiB each).
    n, budget = 1024, 256 << 10
    q_s, k_s, q_t, k_t, mask = make_attention(b=1, n_q=n, n_k=n, heads=2, gqa="student", d_s=8, d_t=8, masked=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss, stats = ops._attention_kl_chunked_fwd(q_s, k_s, q_t, k_t, mask, "reverse_kl", True, 0.4, 0.3, 1.0,
                                                    budget)
        ops._attention_kl_chunked_bwd(torch.ones_like(loss), q_s, k_s, q_t, k_t, mask, stats, "reverse_kl", True,
                                      0.4, 0.3, 1.0, budget)
    allocations = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations, "the profiler recorded no allocation: the test would be vacuous"
    assert max(allocations) <= budget, f"an allocation of {max(allocations)} bytes exceeds the block budget"


def test_chunked_ops_errors():
    q_s, k_s, q_t, k_t, _ = make_attention(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        ops._attention_kl_chunked_fwd(q_s, k_s, q_t, k_t, None, "forward_kl", False, 1.0, 1.0, 1.0, 1 << 20)
    q_s, k_s, q_t, k_t, _ = make_attention()
    with pytest.raises(RuntimeError, match="score_block_bytes must be positive"):
        ops._attention_kl_chunked_fwd(q_s, k_s, q_t, k_t, None, "forward_kl", False, 1.0, 1.0, 1.0, 0)
    with pytest.raises(RuntimeError, match="row_stats must be"):
        ops._attention_kl_chunked_bwd(torch.ones(2, 4, 37), q_s, k_s, q_t, k_t, None, torch.zeros(2, 4, 37, 4),
                                      "forward_kl", False, 1.0, 1.0, 1.0, 1 << 20)


# ------------------------------------------------------------------ CUDA, the public function -----

def cuda_attention(**kwargs):
    return make_attention(device="cuda", dtype=torch.float32, **kwargs)


@CUDA
@pytest.mark.parametrize("kind,causal,masked,gqa", list(itertools.product(KINDS, [False, True], [False, True],
                                                                         list(GQA))))
def test_cuda_float32_every_option(kind, causal, masked, gqa):
    # 137 queries, 201 keys; head dims 24 and 40.
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=137, n_k=201, gqa=gqa, masked=masked)
    check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=causal, attention_mask=mask, reduction="none",
                    temperature=1.5)


@CUDA
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_float32_query_mask_and_reductions(causal, reduction):
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=3, n_q=21, n_k=30, gqa="student", masked=True)
    query_mask = torch.ones(3, 21, dtype=torch.bool, device="cuda")
    query_mask[0, :4] = False
    query_mask[2, -5:] = False
    check_attention(q_s, k_s, q_t, k_t, kind="reverse", causal=causal, attention_mask=mask.long(),
                    query_mask=query_mask, reduction=reduction)


@CUDA
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature,scale", [(0.1, 1.0), (10.0, 1.0), (1.0, 30.0)])
def test_cuda_float32_temperatures_and_large_scores(kind, temperature, scale):
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=70, n_k=150, gqa="both", masked=True, scale=scale)
    check_attention(q_s, k_s, q_t, k_t, kind=kind, temperature=temperature, attention_mask=mask, causal=True,
                    reduction="none")


@CUDA
@pytest.mark.parametrize("d_s,d_t", [(3, 5), (128, 64), (300, 20)])
def test_cuda_float32_head_dims(d_s, d_t):
    # No padding and no head-dim limit on this path (the 16-bit kernels take up to 256).
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=90, n_k=77, heads=2, gqa="student", d_s=d_s, d_t=d_t, masked=True)
    check_attention(q_s, k_s, q_t, k_t, kind="forward", causal=True, attention_mask=mask, reduction="none")


@CUDA
@pytest.mark.parametrize("budget", [1, 4000, 1 << 30])
def test_cuda_chunked_ops_in_blocks(budget):
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=3, n_q=100, n_k=90, heads=4, gqa="both", masked=True)
    check_chunked(q_s, k_s, q_t, k_t, budget=budget, kind="reverse", causal=True, attention_mask=mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("precision", ["high", "medium"])
def test_float32_is_exact_where_the_user_allowed_tf32(device, kind, precision):
    # Under set_float32_matmul_precision("high") PyTorch's own float32 matmuls use TF32 on CUDA (10-bit
    # mantissas: scores of std 6 would be off by ~1e-3, the test's bound is ~1e-6 of them), and under
    # "medium" oneDNN's bfloat16 on CPUs that have it. The op's products stay float32 inside the call
    # (CUDA: the chunked path; CPU: the CPU kernel), and the setting is back afterwards. The
    # references run without reduced precision.
    q_s, k_s, q_t, k_t, mask = make_attention(n_q=100, n_k=120, gqa="student", masked=True, scale=6.0, device=device)
    check_exact_under_precision(precision, nitrobrew.attention_kl, q_s, k_s, q_t, k_t, kind=kind, causal=True,
                                attention_mask=mask)


@CUDA
def test_cuda_float32_scores_never_fill_a_queries_x_keys_matrix():
    # 8 heads x 8192 x 8192 float32 scores are 2 GiB per model; the blocks (64 MiB of scores each, a
    # few alive at once) keep the forward and backward far below that.
    n = 8192
    q_s, k_s, q_t, k_t, _ = cuda_attention(b=1, n_q=n, n_k=n, heads=8, gqa="student", d_s=64, d_t=64)
    q_s.requires_grad_()
    k_s.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True)
    torch.autograd.grad(loss, (q_s, k_s))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full = 8 * n * n * 4
    assert 0 < extra < full / 4, f"{extra} bytes allocated: O(N_q x N_k)"


@CUDA
def test_cuda_float32_deterministic_flag_and_reproducibility():
    # The chunked path has no atomics: both settings give the same bits, run after run.
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=100, n_k=100, gqa="both", masked=True)
    upstream = torch.randn(2, 4, 100, device="cuda")

    def run(deterministic):
        return attention_values_and_grads(nitrobrew.attention_kl, q_s, k_s, q_t, k_t, upstream, causal=True,
                                          attention_mask=mask, reduction="none", deterministic=deterministic)

    first, second, third = run(True), run(True), run(False)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, second, third))


@CUDA
@pytest.mark.parametrize("dynamic", [False, True])
def test_cuda_float32_torch_compile(dynamic):
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=100, n_k=100, gqa="both", masked=True)

    def step(q_s, k_s):
        return nitrobrew.attention_kl(q_s, k_s, q_t, k_t, kind="reverse", causal=True, attention_mask=mask)

    assert_compiled_gradients_match(step, q_s, k_s, dynamic=dynamic)
