"""Attention-distribution KL on CUDA (bfloat16 / float16 on tensor cores; float32 and layout="bhnd" have
their own files, test_attention_kl_float32.py and test_attention_kl_layout.py): values and gradients
against the float64 reference for every option, on lengths that divide no tile, with the
backward the device runs (on Hopper the fused TMA + wgmma kernel, or when deterministic a dq
kernel beside the fused kernel's dk; elsewhere, and with NITROBREW_FORCE_SM80=1, the mma.sync
ones: atomic dq by default, or deterministic);
reproducibility, the float16 gradient range, the chunked dq buffer, torch.compile and errors."""

import itertools

import pytest
import torch

import nitrobrew
from conftest import CUDA, DEV_BUILD
from helpers import GQA, KINDS, check_attention, force_sm80, make_attention

pytestmark = CUDA


def launched_kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("forced_sm80", [False, True])
@pytest.mark.parametrize("d_s,d_t", [(128, 64), (64, 256)])
def test_forward_kernel_family(monkeypatch, forced_sm80, d_s, d_t):
    # Hopper with the sm_90a build runs the TMA + wgmma forward for head dims up to 128; larger
    # ones, NITROBREW_FORCE_SM80=1 (and any other GPU) the mma.sync one, which the whole file then
    # covers (tools/gpu/check.sh test_sm80).
    force_sm80(monkeypatch, forced_sm80)
    q_s, k_s, q_t, k_t, _ = cuda_attention(d_s=d_s, d_t=d_t)
    names = launched_kernels(lambda: nitrobrew.attention_kl(q_s, k_s, q_t, k_t))
    hopper = sum("attention_kl_fwd_hopper_kernel" in n for n in names)
    mma = sum("attention_kl_fwd_kernel" in n for n in names)
    if torch.cuda.get_device_capability() == (9, 0) and not forced_sm80 and max(d_s, d_t) <= 128:
        assert hopper == 1 and mma == 0, names
    else:
        assert hopper == 0 and mma == 1, names


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("forced_sm80", [False, True])
@pytest.mark.parametrize("d_s,d_t", [(128, 64), (256, 64)])
def test_backward_kernel_family(monkeypatch, forced_sm80, d_s, d_t, deterministic):
    # Hopper with the sm_90a build runs a TMA + wgmma backward for head dims up to 128: the fused
    # kernel (dq through a float32 buffer, then converted), or when deterministic a dq kernel and
    # the fused kernel for dk alone; larger head dims, other GPUs and NITROBREW_FORCE_SM80=1 the
    # mma.sync kernels.
    force_sm80(monkeypatch, forced_sm80)
    q_s, k_s, q_t, k_t, _ = cuda_attention(d_s=d_s, d_t=d_t)
    q_s.requires_grad_()
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, deterministic=deterministic)
    names = launched_kernels(lambda: loss.backward())
    fused = sum("attention_kl_bwd_fused_kernel" in n for n in names)
    pair = sum("attention_kl_bwd_hopper_kernel" in n for n in names)
    mma = sum("attention_kl_dk_kernel" in n or "attention_kl_dq_kernel" in n for n in names)
    if torch.cuda.get_device_capability() == (9, 0) and not forced_sm80 and d_s <= 128:
        assert (fused, pair, mma) == ((1, 1, 0) if deterministic else (1, 0, 0)), names
        assert sum("dq_from_fragments_kernel" in n for n in names) == (0 if deterministic else 1), names
    else:
        assert fused == 0 and pair == 0 and mma >= 1, names


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa,d_s,d_t", [("student", 128, 64), ("both", 64, 128), ("teacher", 72, 120)])
def test_long_sequences(causal, gqa, d_s, d_t):
    # Many key tiles per block (the stage ring wraps several times), row blocks (64 to 192 rows)
    # that divide neither length, head dims that are not multiples of the 32-wide slabs; with
    # "student" GQA the teacher's key head changes inside a dk block's query heads.
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=2, n_q=651, n_k=583, heads=4, gqa=gqa, d_s=d_s, d_t=d_t,
                                              masked=True)
    check_attention(q_s, k_s, q_t, k_t, kind="forward", causal=causal, attention_mask=mask, reduction="none")
    check_attention(q_s, k_s, q_t, k_t, kind="reverse", causal=causal, attention_mask=mask, reduction="mean")


@pytest.mark.parametrize("n_q", [50, 130])
def test_teacher_key_head_changes_at_every_query_head(n_q):
    # One student key head for 8 query heads, a teacher key head per query head: a dk block of the
    # Hopper backward reloads the teacher's keys 7 times, at every tile when N_q <= 64 (one query
    # tile per head), every third tile when N_q = 130; the barrier phases alternate each time.
    g = torch.Generator().manual_seed(3)
    q_s, k_s = torch.randn(2, n_q, 8, 64, generator=g), torch.randn(2, 97, 1, 64, generator=g)
    q_t, k_t = torch.randn(2, n_q, 8, 48, generator=g), torch.randn(2, 97, 8, 48, generator=g)
    q_s, k_s, q_t, k_t = (x.to("cuda", torch.bfloat16) for x in (q_s, k_s, q_t, k_t))
    for causal in (False, True):
        check_attention(q_s, k_s, q_t, k_t, kind="reverse", causal=causal, reduction="none")


@pytest.mark.parametrize("forced_sm80", [False, True])
def test_another_batchs_non_finite_inputs_stay_out(monkeypatch, forced_sm80):
    # Tiles that run past a batch's last query or key must read zeros, not the next batch's rows:
    # an infinite entry there would meet dS = 0 in the gradient product and give NaN. Batch 0's
    # loss and gradients must be bitwise those of batch 0 alone.
    force_sm80(monkeypatch, forced_sm80)
    q_s, k_s, q_t, k_t, _ = cuda_attention(b=2, n_q=70, n_k=45, heads=2, d_s=64, d_t=32)
    for x in (q_s, k_s, q_t, k_t):
        x[1, :8] = float("inf")

    def batch0(q_s, k_s, q_t, k_t):
        q_s, k_s = q_s.clone().requires_grad_(), k_s.clone().requires_grad_()
        # (deterministic: the mma.sync path's atomic dq would differ in its last bits)
        loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, reduction="none", deterministic=True)
        upstream = torch.zeros_like(loss)
        upstream[0] = 1.0
        dq, dk = torch.autograd.grad(loss, (q_s, k_s), upstream)
        return loss[0], dq[0], dk[0]

    alone = batch0(*(x[:1] for x in (q_s, k_s, q_t, k_t)))
    both = batch0(q_s, k_s, q_t, k_t)
    assert all(torch.isfinite(x).all() for x in alone)
    for x, y in zip(both, alone):
        assert torch.equal(x, y)


def cuda_attention(**kwargs):
    kwargs.setdefault("dtype", torch.bfloat16)
    return make_attention(device="cuda", **kwargs)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize(
    "kind,causal,masked,gqa", list(itertools.product(KINDS, [False, True], [False, True], list(GQA)))
)
def test_every_option(kind, causal, masked, gqa, deterministic):
    # 137 queries, 201 keys: 3 and 4 tiles of 64, the last ones partial; head dims 24 and 40.
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=137, n_k=201, gqa=gqa, masked=masked)
    check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=causal, attention_mask=mask, reduction="none",
                    temperature=1.5, deterministic=deterministic)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reductions_and_dtypes(reduction, dtype):
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=100, n_k=130, gqa="both", masked=True, dtype=dtype)
    check_attention(q_s, k_s, q_t, k_t, kind="reverse", causal=True, attention_mask=mask, reduction=reduction)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_q,n_k", [(300, 70), (70, 300), (129, 257)])
def test_causal_alignment_with_unequal_lengths(kind, n_q, n_k):
    # More queries than keys: under the bottom-right causal mask the first 230 rows see no key,
    # so whole query tiles (forward, dq) and whole key tiles' early query tiles (dk) are skipped.
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=1, n_q=n_q, n_k=n_k, heads=2, d_s=64, d_t=128, masked=True)
    for deterministic in (False, True):
        check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=True, attention_mask=mask, reduction="none",
                        deterministic=deterministic)


@pytest.mark.parametrize("d_s,d_t", [(64, 128), (128, 64), (128, 128), (80, 96), (3, 5), (256, 200), (136, 16)])
def test_head_dims(d_s, d_t):
    # 64 and 128 are the tuned sizes; the others are padded (to 8 and to 64 / 128 / 256).
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=90, n_k=77, heads=2, gqa="student", d_s=d_s, d_t=d_t, masked=True)
    check_attention(q_s, k_s, q_t, k_t, kind="forward", causal=True, attention_mask=mask, reduction="none")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.1, 10.0])
def test_temperatures(kind, temperature):
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=70, n_k=150, gqa="both", masked=True)
    check_attention(q_s, k_s, q_t, k_t, kind=kind, temperature=temperature, attention_mask=mask, reduction="none")


@pytest.mark.parametrize("kind", KINDS)
def test_large_scores(kind):
    # Scores of magnitude ~1e2 to 1e3: near one-hot rows.
    q_s, k_s, q_t, k_t, _ = cuda_attention(n_q=70, n_k=150, gqa="student", scale=30.0)
    (loss, _, _), _ = check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=True, reduction="none")
    assert loss.abs().max() > 10, "the test should reach large losses"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("causal", [False, True])
def test_scores_that_grow_along_the_keys(kind, causal):
    # Key norms growing 40-fold along the keys, at different rates for the two models: later key
    # tiles hold scores far above every earlier tile's, so the forward's fold moves its reference
    # point (its sums kept relative to it) at many tiles, not only at the first.
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=70, n_k=600, gqa="student", masked=True)
    ramp = torch.linspace(0.2, 8.0, k_s.shape[1], device="cuda", dtype=torch.float64)[None, :, None, None]
    k_s = (k_s.double() * ramp).to(k_s.dtype)
    k_t = (k_t.double() * ramp.sqrt()).to(k_t.dtype)
    (loss, _, _), _ = check_attention(q_s, k_s, q_t, k_t, kind=kind, causal=causal, attention_mask=mask,
                                      reduction="none")
    assert loss.abs().max() > 10, "the test should reach large losses"


def test_float16_gradients_of_a_mean_over_many_rows():
    # dS = dLoss/dscore is rounded to float16 for the tensor cores. With the mean over 4 x 2048
    # rows and probabilities ~1/2048, dS ~ 1e-9 lies below float16's smallest subnormal (6e-8);
    # the kernels scale it into range by max |grad_loss|.
    q_s, k_s, q_t, k_t, _ = cuda_attention(b=1, n_q=2048, n_k=2048, heads=4, d_s=64, d_t=64, dtype=torch.float16)
    for deterministic in (False, True):
        _, (_, dq, dk) = check_attention(q_s, k_s, q_t, k_t, kind="forward", reduction="mean",
                                         deterministic=deterministic)
        assert dq.abs().max() < 1e-4, "the test should reach gradients float16 cannot hold unscaled"


def test_non_contiguous_inputs():
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=100, n_k=100, gqa="none", masked=True)
    # [B, H, N, D] tensors transposed to [B, N, H, D], as attention modules often hold them.
    q_s, k_s, q_t, k_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q_s, k_s, q_t, k_t))
    assert not q_s.is_contiguous()
    check_attention(q_s, k_s, q_t, k_t, kind="forward", attention_mask=mask, reduction="none")


@pytest.mark.parametrize("n_q", [90, 300])
def test_rows_that_see_no_key_give_zero_loss_and_gradient(n_q):
    # With n_q = 300 the first 128-query block sees no key at all (it walks no key tile).
    q_s, k_s, q_t, k_t, _ = cuda_attention(b=2, n_q=n_q, n_k=20, heads=2, d_s=64, d_t=64)
    mask = torch.ones(2, 20, dtype=torch.bool, device="cuda")
    mask[1] = False  # batch 1 attends to nothing
    q_s.requires_grad_()
    k_s.requires_grad_()
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, attention_mask=mask, reduction="none")
    # Query i sees keys j <= i - (n_q - 20): rows before that see none.
    blind = n_q - 20
    assert (loss[:, :, :blind] == 0).all() and (loss[1] == 0).all() and (loss[0, :, blind + 1:] > 0).all()
    loss.sum().backward()
    assert (q_s.grad[:, :blind] == 0).all() and (q_s.grad[1] == 0).all() and (q_s.grad[0, blind + 1:] != 0).any()
    assert (k_s.grad[1] == 0).all() and torch.isfinite(k_s.grad).all()


def test_deterministic_gradients_are_bitwise_reproducible():
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=2, n_q=300, n_k=300, heads=4, gqa="student", d_s=64, d_t=64,
                                              masked=True)

    def grads(deterministic):
        a, b = q_s.clone().requires_grad_(), k_s.clone().requires_grad_()
        nitrobrew.attention_kl(a, b, q_t, k_t, causal=True, attention_mask=mask, deterministic=deterministic).backward()
        return a.grad, b.grad

    first, second = grads(True), grads(True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    atomic = grads(False)
    torch.testing.assert_close(atomic[0], first[0], rtol=2e-2, atol=1e-5)
    torch.testing.assert_close(atomic[1], first[1], rtol=2e-2, atol=1e-5)


@DEV_BUILD
@pytest.mark.parametrize("forced_sm80", [False, True])
@pytest.mark.parametrize("budget", ["1", str(256 << 10)])
def test_dq_buffer_in_chunks(monkeypatch, forced_sm80, budget):
    # The atomic backwards accumulate dq in float32 a chunk of (batches x key heads) at a time: a
    # tiny budget forces one key head per chunk; 256 KiB is two of the three batches per chunk
    # for Hopper's fused kernel (64 KiB per key head: 2 query heads x 2 tiles x 64 x 64 floats).
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=3, n_q=100, n_k=90, heads=4, gqa="student", masked=True)
    force_sm80(monkeypatch, forced_sm80)
    monkeypatch.setenv("NITROBREW_DQ_ACCUM_BYTES", budget)
    check_attention(q_s, k_s, q_t, k_t, kind="reverse", causal=True, attention_mask=mask, reduction="none")


def test_float64_inputs_are_a_clear_error():
    # float32 runs on CUDA (test_attention_kl_float32.py); float64 on the CPU only.
    q_s, k_s, q_t, k_t, _ = make_attention(device="cuda", dtype=torch.float64)
    with pytest.raises(TypeError, match="bfloat16 or float16 .* or float32"):
        nitrobrew.attention_kl(q_s, k_s, q_t, k_t)
    with pytest.raises(RuntimeError, match="bfloat16 or float16 .* or float32"):
        torch.ops.nitrobrew.attention_kl_fwd(q_s, k_s, q_t, k_t, None, "forward_kl", False, 1.0, 1.0, 1.0, False)


def test_errors_of_the_cuda_op_reach_python():
    # Raised by the op's C++ checks (the Python wrapper checks neither of these).
    q_s, k_s, q_t, k_t, _ = cuda_attention(d_s=264, d_t=64)
    with pytest.raises(RuntimeError, match="head dims up to 256"):
        nitrobrew.attention_kl(q_s, k_s, q_t, k_t)
    q_s, k_s, q_t, k_t, _ = cuda_attention(heads=4)
    with pytest.raises(RuntimeError, match="multiple of its key heads"):
        torch.ops.nitrobrew.attention_kl_fwd(q_s, k_s[:, :, :3], q_t, k_t, None, "forward_kl", False, 1.0, 1.0, 1.0,
                                             False)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_with_backward(dynamic):
    q_s, k_s, q_t, k_t, mask = cuda_attention(n_q=100, n_k=100, gqa="both", masked=True)

    def step(q_s, k_s):
        return nitrobrew.attention_kl(q_s, k_s, q_t, k_t, kind="reverse", causal=True, attention_mask=mask,
                                      deterministic=True)

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    a, b = q_s.clone().requires_grad_(), k_s.clone().requires_grad_()
    loss = compiled(a, b)
    loss.backward()
    a_ref, b_ref = q_s.clone().requires_grad_(), k_s.clone().requires_grad_()
    step(a_ref, b_ref).backward()
    torch.testing.assert_close(loss, step(q_s, k_s))
    assert torch.equal(a.grad, a_ref.grad) and torch.equal(b.grad, b_ref.grad)


def test_opcheck():
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=2, n_q=70, n_k=80, heads=4, gqa="teacher", d_s=64, d_t=32,
                                              masked=True)
    args = (q_s, k_s, q_t, k_t, mask, "reverse_kl", True, 0.4, 0.3, 1.3, True)
    torch.library.opcheck(torch.ops.nitrobrew.attention_kl_fwd.default, args)
    _, row_stats = torch.ops.nitrobrew.attention_kl_fwd(*args)
    grad = torch.randn(2, 4, 70, device="cuda")
    torch.library.opcheck(torch.ops.nitrobrew.attention_kl_bwd.default,
                          (grad, q_s, k_s, q_t, k_t, mask, row_stats, "reverse_kl", True, 0.4, 0.3, 1.3, True))


def test_no_buffer_of_queries_times_keys_is_allocated():
    # 2048 x 2048 float32 scores take 16 MiB per head; the largest allocation allowed here is an
    # eighth of that (the dq accumulator is [N_q, H, D] float32: 2 MiB).
    n = 2048
    q_s, k_s, q_t, k_t, mask = cuda_attention(b=1, n_q=n, n_k=n, heads=4, gqa="student", d_s=64, d_t=64, masked=True)
    q_s.requires_grad_()
    k_s.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, attention_mask=mask).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert 0 < extra < n * n * 4 * 4 / 8, f"{extra} bytes allocated: O(N_q x N_k)"
