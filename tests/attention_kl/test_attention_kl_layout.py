"""layout="bhnd": [B, H, N, D] inputs, as Hugging Face attention modules and scaled_dot_product_attention
hold them. Values and gradients equal those of layout="bnhd" on the same tensors transposed, on the CPU
and CUDA (every kernel family, both dtypes' paths, strides of packed projections, padded head dims);
the CUDA kernels read such inputs without a copy; errors name the layout."""

import itertools

import pytest
import torch

import nitrobrew
from conftest import CUDA, DEVICES
from helpers import KINDS, assert_compiled_gradients_match, force_sm80, make_attention


def to_bhnd(*tensors):
    """[B, N, H, D] -> [B, H, N, D] tensors of their own (contiguous, as a model holds them)."""
    return tuple(t.transpose(1, 2).contiguous() for t in tensors)


def values_and_grads(q_s, k_s, q_t, k_t, upstream, **options):
    # detach(), not clone(): a clone of a strided slice would be contiguous.
    q_s = q_s.detach().requires_grad_()
    k_s = k_s.detach().requires_grad_()
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, **options)
    dq, dk = torch.autograd.grad(loss, (q_s, k_s), upstream)
    return loss.detach(), dq, dk


def assert_same_as_bnhd(q_s, k_s, q_t, k_t, *, exact, **options):
    """layout="bhnd" on [B, H, N, D] tensors vs the default layout on contiguous [B, N, H, D] copies of
    them (so that the kernels read the two at different strides): the same loss, and gradients that are
    the transposes of each other (bitwise where `exact`)."""
    reduction = options.get("reduction", "mean")
    b, h, n_q = q_s.shape[:3]
    upstream = torch.randn((b, h, n_q) if reduction == "none" else (), device=q_s.device)
    ours = values_and_grads(q_s, k_s, q_t, k_t, upstream, layout="bhnd", **options)
    theirs = values_and_grads(*(t.transpose(1, 2).contiguous() for t in (q_s, k_s, q_t, k_t)), upstream, **options)
    assert ours[1].shape == q_s.shape and ours[2].shape == k_s.shape, "gradients must have the inputs' shapes"
    for name, a, b in zip(("loss", "dq_s", "dk_s"), ours, (theirs[0], theirs[1].transpose(1, 2),
                                                          theirs[2].transpose(1, 2))):
        if exact:
            assert torch.equal(a, b), f"{name}: bhnd differs from bnhd by {(a.double() - b.double()).abs().max():.3e}"
        else:
            torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
    return ours


@pytest.mark.parametrize("kind,causal,gqa", list(itertools.product(KINDS, [False, True], ["none", "both"])))
def test_cpu_bhnd_equals_bnhd(kind, causal, gqa):
    q_s, k_s, q_t, k_t, mask = make_attention(gqa=gqa, masked=True)
    assert_same_as_bnhd(*to_bhnd(q_s, k_s, q_t, k_t), exact=False, kind=kind, causal=causal, attention_mask=mask,
                        reduction="none", temperature=1.5)


@pytest.mark.parametrize("device", DEVICES)
def test_query_mask_and_mean_with_bhnd(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q_s, k_s, q_t, k_t, mask = make_attention(b=2, n_q=21, n_k=30, gqa="student", masked=True, dtype=dtype,
                                              device=device)
    query_mask = torch.ones(2, 21, dtype=torch.int64, device=device)
    query_mask[0, :4] = 0
    assert_same_as_bnhd(*to_bhnd(q_s, k_s, q_t, k_t), exact=device == "cuda", causal=True, attention_mask=mask,
                        query_mask=query_mask, deterministic=True)


@pytest.mark.parametrize("forced_sm80", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,gqa,d_s,d_t", [(False, "none", 64, 64), (True, "both", 128, 64),
                                                (True, "student", 72, 200), (False, "teacher", 20, 44)])
@CUDA
def test_cuda_bhnd_equals_bnhd(monkeypatch, forced_sm80, deterministic, dtype, causal, gqa, d_s, d_t):
    # Head dims: Hopper's TMA kernels (up to 128), the mma.sync ones (200), and 20 / 44, which are padded
    # to multiples of 8 (a copy). Lengths that divide no tile. Bitwise equal where dq has one writer.
    force_sm80(monkeypatch, forced_sm80)
    q_s, k_s, q_t, k_t, mask = make_attention(b=2, n_q=137, n_k=201, heads=4, gqa=gqa, d_s=d_s, d_t=d_t,
                                              masked=True, dtype=dtype, device="cuda")
    assert_same_as_bnhd(*to_bhnd(q_s, k_s, q_t, k_t), exact=deterministic, kind="reverse" if causal else "forward",
                        causal=causal, attention_mask=mask, reduction="none", deterministic=deterministic)


@pytest.mark.parametrize("device", DEVICES)
def test_bhnd_slices_of_packed_projections(device):
    # q and k cut out of one [B, H, N, 3 D] projection (row stride 3 D, not D), and a key tensor whose
    # single head has an arbitrary stride: strided views read in place on CUDA.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)
    packed_s = torch.randn(2, 4, 90, 3 * 64, generator=g).to(device, dtype)
    packed_t = torch.randn(2, 4, 90, 3 * 32, generator=g).to(device, dtype)
    q_s, k_s = packed_s[..., :64], packed_s[:, :1, :, 64:128]  # GQA: one student key head
    q_t, k_t = packed_t[..., :32], packed_t[..., 32:64]
    assert q_s.stride(2) == 3 * 64 and k_s.stride(2) == 3 * 64
    assert_same_as_bnhd(q_s, k_s, q_t, k_t, exact=device == "cuda", causal=True, reduction="none",
                        deterministic=True)


@CUDA
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_float32_bhnd_equals_bnhd(causal):
    q_s, k_s, q_t, k_t, mask = make_attention(b=2, n_q=70, n_k=90, gqa="both", masked=True, device="cuda")
    assert_same_as_bnhd(*to_bhnd(q_s, k_s, q_t, k_t), exact=False, kind="reverse", causal=causal,
                        attention_mask=mask, reduction="none")


def _peak_extra_bytes(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, out


@CUDA
@pytest.mark.parametrize("forced_sm80", [False, True])
def test_cuda_reads_bhnd_inputs_without_a_copy(monkeypatch, forced_sm80):
    # Four [1, 4, 4096, 128] bfloat16 inputs of 4 MiB each. The forward allocates only its outputs
    # (loss and row statistics: 384 KiB); a copy of any input would add 4 MiB. The backward allocates
    # dq, dk and a float32 dq buffer (16 MiB in all) and the per-row data (under 1 MiB); copies of the
    # inputs would add 16 MiB more. The control: with head dim 100 (not a multiple of 8) the inputs
    # must be copied (padded to 104), and the same measure sees it.
    force_sm80(monkeypatch, forced_sm80)

    def inputs(d):
        g = torch.Generator(device="cuda").manual_seed(0)
        return [torch.randn(1, 4, 4096, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]

    q_s, k_s, q_t, k_t = inputs(128)
    one_input = q_s.numel() * q_s.element_size()
    with torch.no_grad():
        forward, _ = _peak_extra_bytes(
            lambda: nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, layout="bhnd", reduction="none"))
    assert 0 < forward < one_input / 4, f"the forward allocated {forward} bytes: an input was copied"

    q_s.requires_grad_()
    k_s.requires_grad_()
    loss = nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, layout="bhnd")
    backward, grads = _peak_extra_bytes(lambda: torch.autograd.grad(loss, (q_s, k_s)))
    assert grads[0].shape == q_s.shape and grads[1].shape == k_s.shape
    assert backward < 4 * one_input + (2 << 20), f"the backward allocated {backward} bytes: inputs were copied"

    padded = inputs(100)
    with torch.no_grad():
        control, _ = _peak_extra_bytes(
            lambda: nitrobrew.attention_kl(*padded, causal=True, layout="bhnd", reduction="none"))
    assert control > one_input, f"the control allocated only {control} bytes: the measure cannot see a copy"


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(layout="BHND"), ValueError, "layout must be 'bnhd' .* or 'bhnd'"),
        (dict(layout=None), ValueError, "layout must be"),
        (dict(q_s=torch.randn(2, 4, 5)), ValueError, "q_s must be \\[B, H, N, D\\] \\(layout='bhnd'\\)"),
        (dict(q_t=torch.randn(2, 4, 6, 8)), ValueError, "q_t must be \\[B, H, N_q, D_t\\] .* got \\(2, 4, 6, 8\\)"),
        (dict(k_s=torch.randn(2, 3, 7, 6)), ValueError,
         "multiple of its key heads H_ks \\(3\\): k_s is \\[B, H_ks, N_k, D_s\\]"),
        (dict(k_t=torch.randn(2, 1, 6, 8)), ValueError, "same number of keys N_k, got 7 and 6"),
        (dict(attention_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError,
         "attention_mask must be \\[B, N\\] = \\[2, 7\\]"),
    ],
)
def test_bad_bhnd_input_is_a_clear_error(change, error, match):
    # [B, H, N, D]: 2 batches, 4 query heads, 5 queries, 7 keys; the student's 2 key heads, the teacher's 1.
    args = dict(q_s=torch.randn(2, 4, 5, 6), k_s=torch.randn(2, 2, 7, 6), q_t=torch.randn(2, 4, 5, 8),
                k_t=torch.randn(2, 1, 7, 8))
    options = {"layout": "bhnd", **{key: value for key, value in change.items() if key not in args}}
    args.update({key: value for key, value in change.items() if key in args})
    with pytest.raises(error, match=match):
        nitrobrew.attention_kl(args["q_s"], args["k_s"], args["q_t"], args["k_t"], **options)


def test_bhnd_through_torch_compile():
    q_s, k_s, q_t, k_t, mask = make_attention(gqa="student", masked=True)
    q_s, k_s, q_t, k_t = to_bhnd(q_s, k_s, q_t, k_t)

    def step(q_s, k_s):
        return nitrobrew.attention_kl(q_s, k_s, q_t, k_t, causal=True, attention_mask=mask, layout="bhnd")

    assert_compiled_gradients_match(step, q_s, k_s)
