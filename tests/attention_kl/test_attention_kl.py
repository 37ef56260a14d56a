"""Attention-distribution KL: values and gradients against the float64 reference for every
option, the operator layer (opcheck, gradcheck, torch.compile), that no [N_q x N_k] buffer is
allocated, and bad input, on the CPU kernels (test_attention_kl_cuda.py has the CUDA ones)."""

import itertools

import pytest
import torch

import nitrobrew
from conftest import CUDA
from helpers import GQA, KINDS, check_attention, make_attention

@pytest.mark.parametrize(
    "kind,causal,masked,gqa,reduction",
    list(itertools.product(KINDS, [False, True], [False, True], list(GQA), ["none", "sum", "mean"])),
)
def test_every_option(kind, causal, masked, gqa, reduction):
    # 37 queries, 45 keys (tiles of 64 x 256 on the CPU: neither divides); student and teacher
    # head dims differ.
    q_s, k_s, q_t, k_t, mask = make_attention(gqa=gqa, masked=masked)
    check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=causal, attention_mask=mask, reduction=reduction,
                    temperature=1.5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_q,n_k", [(300, 70), (70, 300), (129, 257)])
def test_several_tiles_and_causal_alignment(kind, n_q, n_k):
    # More queries than keys: under the bottom-right causal mask the first 230 rows see no key.
    q_s, k_s, q_t, k_t, mask = make_attention(b=1, n_q=n_q, n_k=n_k, heads=2, gqa="none", d_s=16, d_t=8,
                                              masked=True)
    check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=True, attention_mask=mask, reduction="none")


def test_rows_that_see_no_key_give_zero_loss_and_gradient():
    q_s, k_s, q_t, k_t, _ = make_attention(b=2, n_q=9, n_k=5, heads=2, d_s=8, d_t=8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False  # batch 1 attends to nothing
    q_s.requires_grad_()
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, attention_mask=mask, reduction="none")
    # Causal with 9 queries and 5 keys: query i sees keys j <= i - 4, so rows 0-3 see none and
    # row 4 sees one (both distributions one-hot: KL 0).
    assert (loss[:, :, :5] == 0).all() and (loss[1] == 0).all() and (loss[0, :, 5:] > 0).all()
    loss.sum().backward()
    assert (q_s.grad[:, :5] == 0).all() and (q_s.grad[1] == 0).all() and (q_s.grad[0, 5:] != 0).any()
    mean = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, attention_mask=mask)
    torch.testing.assert_close(mean, loss.sum() / (5 * 2))  # 5 rows of batch 0 see a key, x 2 heads
    nothing = torch.zeros(2, 5, dtype=torch.bool)
    assert nitrobrew.attention_kl(q_s, k_s, q_t, k_t, attention_mask=nothing).item() == 0.0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.1, 10.0])
def test_temperatures(kind, temperature):
    q_s, k_s, q_t, k_t, mask = make_attention(gqa="both", masked=True)
    check_attention(q_s, k_s, q_t, k_t, kind=kind, temperature=temperature, attention_mask=mask, reduction="none")


@pytest.mark.parametrize("kind", KINDS)
def test_large_scores(kind):
    # Scores of magnitude ~1e2 to 1e3: near one-hot rows.
    q_s, k_s, q_t, k_t, _ = make_attention(gqa="student", scale=30.0)
    (loss, _, _), _ = check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=True, reduction="none")
    assert loss.abs().max() > 10, "the test should reach large losses"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_explicit_scales(dtype):
    q_s, k_s, q_t, k_t, mask = make_attention(dtype=dtype, gqa="teacher", masked=True)
    check_attention(q_s, k_s, q_t, k_t, kind="reverse", causal=True, attention_mask=mask, scale_s=0.3,
                    scale_t=0.05, reduction="none")


def test_non_contiguous_inputs():
    q_s, k_s, q_t, k_t, mask = make_attention(gqa="none", masked=True)
    # [B, H, N, D] tensors transposed to [B, N, H, D], as attention modules often hold them.
    q_s, k_s, q_t, k_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q_s, k_s, q_t, k_t))
    assert not q_s.is_contiguous()
    check_attention(q_s, k_s, q_t, k_t, kind="forward", attention_mask=mask, reduction="none")


def _op_args(q_s, k_s, q_t, k_t, mask, divergence="forward_kl", causal=True):
    return (q_s, k_s, q_t, k_t, mask, divergence, causal, 0.4, 0.3, 1.3, False)


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("masked", [False, True])
def test_opcheck(divergence, masked):
    q_s, k_s, q_t, k_t, mask = make_attention(b=2, n_q=5, n_k=7, heads=2, gqa="none", d_s=3, d_t=4, masked=masked)
    q_s.requires_grad_()
    k_s.requires_grad_()
    torch.library.opcheck(torch.ops.nitrobrew.attention_kl_fwd.default, _op_args(q_s, k_s, q_t, k_t, mask, divergence))
    _, row_stats = torch.ops.nitrobrew.attention_kl_fwd(*_op_args(q_s, k_s, q_t, k_t, mask, divergence))
    grad = torch.randn(2, 2, 5)
    torch.library.opcheck(
        torch.ops.nitrobrew.attention_kl_bwd.default,
        (grad, q_s.detach(), k_s.detach(), q_t, k_t, mask, row_stats, divergence, True, 0.4, 0.3, 1.3, False),
    )


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_float64(kind):
    q_s, k_s, q_t, k_t, mask = make_attention(b=1, n_q=6, n_k=7, heads=2, gqa="student", d_s=3, d_t=4,
                                              dtype=torch.float64, masked=True)
    q_s.requires_grad_()
    k_s.requires_grad_()
    torch.autograd.gradcheck(
        lambda a, b: nitrobrew.attention_kl(a, b, q_t, k_t, kind=kind, causal=True, attention_mask=mask,
                                            reduction="none"),
        (q_s, k_s),
    )


@pytest.mark.parametrize("masked", [False, True])  # the "mean" denominator is computed two ways
@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_with_backward(dynamic, masked):
    q_s, k_s, q_t, k_t, mask = make_attention(gqa="both", masked=masked)

    def step(q_s, k_s):
        return nitrobrew.attention_kl(q_s, k_s, q_t, k_t, kind="reverse", causal=True, attention_mask=mask)

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    a = q_s.clone().requires_grad_()
    b = k_s.clone().requires_grad_()
    loss = compiled(a, b)
    loss.backward()
    a_ref = q_s.clone().requires_grad_()
    b_ref = k_s.clone().requires_grad_()
    step(a_ref, b_ref).backward()
    torch.testing.assert_close(loss, step(q_s, k_s))
    torch.testing.assert_close(a.grad, a_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)


def test_no_buffer_of_queries_times_keys_is_allocated():
    # 1024 x 1024 scores take 4 MiB per head and model in float32; the CPU kernel's blocks are
    # 64 x 256.
    n = 1024
    q_s, k_s, q_t, k_t, mask = make_attention(b=1, n_q=n, n_k=n, heads=2, gqa="student", d_s=8, d_t=8, masked=True)
    q_s.requires_grad_()
    k_s.requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, attention_mask=mask)
        loss.backward()
    allocations = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations, "the profiler recorded no allocation: the test would be vacuous"
    assert max(allocations) < n * n * 4 / 8, f"an allocation of {max(allocations)} bytes is O(N_q x N_k)"


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(q_s=torch.randn(2, 5, 4)), ValueError, "q_s must be \\[B, N, H, D\\]"),
        (dict(k_s=torch.randn(2, 7, 3, 6)), ValueError, "multiple of its key heads"),
        (dict(k_t=torch.randn(2, 6, 2, 8)), ValueError, "same number of keys"),
        (dict(k_s=torch.randn(2, 7, 2, 5)), ValueError, "head dim"),
        (dict(q_t=torch.randn(2, 5, 3, 8)), ValueError, "q_t must be \\[B, N_q, H, D_t\\]"),
        (dict(k_t=torch.randn(3, 7, 1, 8)), ValueError, "same batch size"),
        (dict(q_t=torch.randn(2, 5, 4, 8, dtype=torch.float64)), RuntimeError, "all four must match"),
        (dict(q_s=torch.randint(0, 3, (2, 5, 4, 6))), TypeError, "q_s must be float32"),
        (dict(kind="jsd"), ValueError, "kind must be"),
        (dict(temperature=0.0), ValueError, "temperature must be"),
        (dict(scale_s=float("nan")), ValueError, "scale_s must be"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(attention_mask=torch.ones(2, 7)), TypeError, "attention_mask must be a bool or integer tensor"),
        (dict(attention_mask=torch.ones(2, 6, dtype=torch.bool)), ValueError, "attention_mask must be \\[B, N\\] = \\[2, 7\\]"),
        (dict(query_mask=torch.ones(2, 7, dtype=torch.bool)), ValueError, "query_mask must be \\[B, N\\] = \\[2, 5\\]"),
        (dict(query_mask=torch.ones(2, 5, dtype=torch.bool, device="meta")), ValueError, "query_mask must be on cpu"),
        (dict(q_s=torch.randn(2, 5, 4, 0), k_s=torch.randn(2, 7, 2, 0)), ValueError, "q_s must have a head dim D >= 1"),
        (dict(causal=1), TypeError, "causal and deterministic must be bools"),
    ],
)
def test_bad_input_is_a_clear_error(change, error, match):
    args = dict(q_s=torch.randn(2, 5, 4, 6), k_s=torch.randn(2, 7, 2, 6), q_t=torch.randn(2, 5, 4, 8),
                k_t=torch.randn(2, 7, 1, 8))
    options = {key: value for key, value in change.items() if key not in args}
    args.update({key: value for key, value in change.items() if key in args})
    with pytest.raises(error, match=match):
        nitrobrew.attention_kl(args["q_s"], args["k_s"], args["q_t"], args["k_t"], **options)


@pytest.mark.parametrize("reduction", ["mean", "none", "sum"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_query_mask_and_integer_masks(device, causal, reduction):
    # Hugging Face's int64 0/1 attention_mask as it is, and padded query rows left out of the loss,
    # the gradient and the mean; against the float64 reference with the same masks.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q_s, k_s, q_t, k_t, mask = make_attention(b=3, n_q=21, n_k=30, gqa="student", masked=True, dtype=dtype,
                                              device=device)
    query_mask = torch.ones(3, 21, dtype=torch.int64, device=device)
    query_mask[0, :4] = 0  # left padding
    query_mask[2, -5:] = 0  # right padding
    check_attention(q_s, k_s, q_t, k_t, causal=causal, attention_mask=mask.long(), query_mask=query_mask,
                    reduction=reduction)
    q_s = q_s.detach().requires_grad_()
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=causal, attention_mask=mask.long(),
                                  query_mask=query_mask.bool(), reduction="none")
    loss.sum().backward()
    assert (loss[0, :, :4] == 0).all() and (q_s.grad[0, :4] == 0).all() and (q_s.grad[2, -5:] == 0).all()
    as_bool = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=causal, attention_mask=mask, reduction="none")
    as_int = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=causal, attention_mask=mask.int(), reduction="none")
    assert torch.equal(as_bool, as_int)
