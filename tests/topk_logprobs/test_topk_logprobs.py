"""nitrobrew.topk_logprobs (the teacher's top-K from hidden states) against the float64 reference: the
log-probabilities, ids (ties to the lower id), log-normalizer and entropy; padding, the logit transforms,
the non-finite rule, bad input and torch.compile. The chunked path (CUDA's for now) runs on the CPU too."""

import contextlib
import functools
import math
import os

import pytest
import torch

import nitrobrew
from conftest import CUDA, DEV_BUILD
from nitrobrew import reference
from nitrobrew._topk_logprobs_chunked import topk_logprobs_chunked


def chunked(x, w, k, *, temperature=1.0, bias=None, logit_scale=1.0, softcap=None, vocab_size=None,
            return_stats=False, rows=7):
    """The chunked path on any device, in small chunks of rows, through the public function's layout."""
    lead = x.shape[:-1]
    vocab_size = vocab_size or w.shape[0]
    lp, ids, stats = topk_logprobs_chunked(x.reshape(-1, x.shape[-1]), w, k, bias, temperature, softcap, logit_scale,
                                           vocab_size, rows=rows)
    out = (lp.reshape(*lead, k), ids.reshape(*lead, k))
    return out + (stats[:, 0].reshape(lead), stats[:, 1].reshape(lead)) if return_stats else out


def on_cuda(x, w, k, **options):
    """The op's CUDA kernel on CPU tensors: inputs moved to the GPU, outputs back."""
    options = {key: (val.cuda() if torch.is_tensor(val) else val) for key, val in options.items()}
    return tuple(t.cpu() for t in nitrobrew.topk_logprobs(x.cuda(), w.cuda(), k, **options))


@contextlib.contextmanager
def walk(setting):
    """The CUDA op's path forced (a development build's NITROBREW_TOPK_LOGPROBS_WALK): "off" (the row kernel's), or
    "SAMPLE:CAP", the walk with that sample and list capacity, float32 inputs included."""
    old = os.environ.get("NITROBREW_TOPK_LOGPROBS_WALK")
    os.environ["NITROBREW_TOPK_LOGPROBS_WALK"] = setting
    try:
        yield
    finally:
        if old is None:
            del os.environ["NITROBREW_TOPK_LOGPROBS_WALK"]
        else:
            os.environ["NITROBREW_TOPK_LOGPROBS_WALK"] = old


def on_cuda_walk(setting):
    def run(x, w, k, **options):
        with walk(setting):
            return on_cuda(x, w, k, **options)
    return run


# The walk's settings under test: lists that hold every row's k best (a sample of 1024 columns, room for 8192
# entries), and lists of 48 entries, which many rows overflow, so that the row kernel redoes them.
WALK = "1024:8192"
WALK_OVERFLOWING = "16:48"
IMPLEMENTATIONS = {"op": nitrobrew.topk_logprobs, "chunked": chunked, "cuda": on_cuda,
                   "cuda_walk": on_cuda_walk(WALK), "cuda_walk_overflowing": on_cuda_walk(WALK_OVERFLOWING)}
# Every implementation: the CPU op, the chunked composite (on the CPU), the CUDA op (its path for the inputs),
# and its walk path forced (a development build).
CUDA_WALK = [pytest.param(name, marks=[CUDA, DEV_BUILD]) for name in ("cuda_walk", "cuda_walk_overflowing")]
ALL = ["op", "chunked", pytest.param("cuda", marks=CUDA)] + CUDA_WALK


def check(x, w, k, *, implementation=nitrobrew.topk_logprobs, atol=None, **options):
    """The outputs against the float64 reference. Where the inputs are float64 the ids must be the
    reference's exactly; otherwise the products' rounding may reorder near-ties, so each returned
    log-probability must be the reference's at its id, and the j-th of them no smaller than the reference's
    j-th largest (none of the true top-K missed by more than the tolerance)."""
    lp, ids, lse, ent = implementation(x, w, k, return_stats=True, **options)
    ref_lp, ref_ids, ref_lse, ref_ent = reference.topk_logprobs(x, w, k, **options)
    exact = x.dtype == torch.float64
    if atol is None:
        atol = 1e-9 if exact else 2e-5 * max(1.0, ref_lse.abs().nan_to_num().max().item())
    assert lp.dtype == (torch.float64 if exact else torch.float32) and ids.dtype == torch.int64
    assert lp.shape == ids.shape == (*x.shape[:-1], k) and lse.shape == ent.shape == x.shape[:-1]
    defined = ~ref_lse.isnan()
    assert torch.equal(lse.isnan(), ~defined) and torch.equal(ent.isnan(), ~defined)
    assert lp[~defined].isnan().all() and torch.equal(ids[~defined], ref_ids[~defined])
    lp, ids, ref_lp = lp[defined].double(), ids[defined], ref_lp[defined]
    vocab = options.get("vocab_size") or w.shape[0]
    assert ((ids >= 0) & (ids < vocab)).all()
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an id twice in a row"
    full_logp = (reference.model_logits(x.double(), w.double()[:vocab], logit_scale=options.get("logit_scale", 1.0),
                                        bias=None if options.get("bias") is None else options["bias"].double()[:vocab],
                                        softcap=options.get("softcap"))
                 / options.get("temperature", 1.0)).log_softmax(-1)[defined]
    finite = lp > -math.inf
    torch.testing.assert_close(lp[finite], full_logp.gather(-1, ids)[finite], rtol=0, atol=atol)
    assert torch.equal(finite, ref_lp > -math.inf)
    assert (lp[..., :-1] >= lp[..., 1:]).all(), "not sorted"
    assert (lp[finite] >= ref_lp[finite] - atol).all(), "a larger log-probability was missed"
    if exact:  # the same ids wherever no near-tie (within the products' rounding) could swap two
        ref_all = full_logp.sort(-1, descending=True).values[..., :k + 1]
        if ref_all.shape[-1] == k:  # k = V: nothing after the last
            ref_all = torch.nn.functional.pad(ref_all, (0, 1), value=-math.inf)
        gaps = ref_all.diff(dim=-1).abs() > atol
        clear = gaps & torch.cat([torch.ones_like(gaps[..., :1]), gaps[..., :-1]], -1)
        assert torch.equal(ids[clear], ref_ids[defined][clear])
    torch.testing.assert_close(lse[defined].double(), ref_lse[defined], rtol=0, atol=atol)
    torch.testing.assert_close(ent[defined].double(), ref_ent[defined], rtol=0, atol=10 * atol)
    return lp, ids


def problem(n, v, d, *, dtype=torch.float32, device="cpu", scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * scale
    w = torch.randn(v, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    return x.to(device, dtype), w.to(device, dtype)


@pytest.mark.parametrize("implementation, dtype", [("op", torch.float32), ("op", torch.float64),
                                                   ("chunked", torch.float32),  # chunked and CUDA: 16/32-bit
                                                   pytest.param("cuda", torch.float32, marks=CUDA)]
                         + [pytest.param(p.values[0], dtype, marks=p.marks) for p in CUDA_WALK
                            for dtype in (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("k", [1, 5, 64, 301])
def test_against_the_reference(implementation, dtype, k):
    x, w = problem(37, 1003, 24, dtype=dtype, scale=3.0)
    check(x, w, k, implementation=IMPLEMENTATIONS[implementation])


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("options", [
    dict(temperature=0.05), dict(temperature=20.0), dict(logit_scale=0.3), dict(softcap=5.0),
    dict(bias=True), dict(vocab_size=900), dict(bias=True, logit_scale=2.5, softcap=30.0, temperature=0.7, vocab_size=777),
], ids=lambda o: "-".join(f"{key}={val}" for key, val in o.items()))
def test_logit_transforms_and_padding(implementation, options):
    x, w = problem(2 * 13, 1003, 16, scale=4.0, seed=1)
    x = x.reshape(2, 13, 16)  # leading dimensions
    if options.get("bias"):
        options = dict(options, bias=torch.randn(1003, generator=torch.Generator().manual_seed(2)) * 3)
    if "vocab_size" in options:
        w[options["vocab_size"]:] *= 100  # padding rows whose logits would win were they read
    check(x, w, 20, implementation=IMPLEMENTATIONS[implementation], **options)
    check(x.double(), w.double(), 20, **{key: (val.double() if torch.is_tensor(val) else val)
                                        for key, val in options.items()})


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ties_go_to_the_lower_id(implementation, dtype):
    # x = 0 makes every logit its bias exactly: many equal values, straddling the k-th place.
    v = 50
    bias = torch.tensor([float(i % 5) for i in range(v)], dtype=dtype)  # ten ids at each of 0..4
    x, w = torch.zeros(3, 8, dtype=dtype), torch.randn(v, 8).to(dtype)
    lp, ids = IMPLEMENTATIONS[implementation](x, w, 14, bias=bias)
    expected = torch.tensor([4, 9, 14, 19, 24, 29, 34, 39, 44, 49, 3, 8, 13, 18])
    assert torch.equal(ids, expected.expand(3, 14))
    ref_lp, ref_ids, _, _ = reference.topk_logprobs(x, w, 14, bias=bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-6)


@pytest.mark.parametrize("implementation", ALL)
def test_minus_zero_ties_with_plus_zero(implementation):
    # 0 * (-1) is -0.0: equal to +0.0, so the lower id comes first whatever the sign bits.
    x, w = torch.zeros(2, 1), torch.tensor([[-1.0], [1.0], [-2.0]])
    bias = torch.tensor([0.0, -0.0, 0.0])
    lp, ids = IMPLEMENTATIONS[implementation](x, w, 3, bias=bias)
    assert torch.equal(ids, torch.tensor([[0, 1, 2], [0, 1, 2]]))


@pytest.mark.parametrize("implementation", ALL)
def test_a_large_vocabulary_keeps_the_normalizer_accurate(implementation):
    # 262144 terms summed for the log-normalizer (Gemma's vocabulary): float32 running sums would drift.
    x, w = problem(4, 262144, 32, scale=3.0, seed=2)
    check(x, w, 8, implementation=IMPLEMENTATIONS[implementation], atol=2e-5 * 15)


@pytest.mark.parametrize("implementation", ALL)
@pytest.mark.parametrize("offset", [1e4, -3e5])
def test_large_logits_keep_absolute_accuracy(implementation, offset):
    # Logits near 1e4: the sums must not carry the maximum's rounding (~1e-8 * |max|), which tolerances relative
    # to the log-normalizer would not see. Products exact in float32 (multiples of 1/8), so the reference sees
    # the very logits the kernels do.
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (6, 16), generator=g).float() / 2
    w = torch.randint(-4, 5, (5003, 16), generator=g).float() / 4
    bias = torch.full((5003,), offset)
    lp, ids, lse, entropy = IMPLEMENTATIONS[implementation](x, w, 8, bias=bias, return_stats=True)
    z = x.double() @ w.double().T + offset
    ref_lse = z.logsumexp(-1)
    p = (z - ref_lse[:, None]).exp()
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-7, atol=2e-5)
    torch.testing.assert_close(entropy.double(), -(p * (z - ref_lse[:, None])).sum(-1), rtol=0, atol=2e-4)
    torch.testing.assert_close(lp.double(), z.gather(-1, ids) - ref_lse[:, None], rtol=0, atol=2e-5)
    ref_lp = (z - ref_lse[:, None]).topk(8, dim=-1).values
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=2e-5)


@pytest.mark.parametrize("implementation", ALL)
def test_a_single_huge_logit(implementation):
    # One logit of 1e10 beside zeros: log-normalizer 1e10, that entry's log-probability 0, entropy 0.
    x, w = torch.ones(2, 1), torch.zeros(3001, 1)
    bias = torch.zeros(3001)
    bias[1234] = 1e10
    lp, ids, lse, entropy = IMPLEMENTATIONS[implementation](x, w, 4, bias=bias, return_stats=True)
    assert ids[:, 0].tolist() == [1234, 1234]
    torch.testing.assert_close(lp[:, 0], torch.zeros(2), rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, torch.full((2,), 1e10), rtol=1e-7, atol=0)
    torch.testing.assert_close(entropy, torch.zeros(2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("implementation", ALL)
def test_16_bit_inputs(implementation):
    for dtype in (torch.bfloat16, torch.float16):
        x, w = problem(29, 517, 32, dtype=dtype, scale=2.0, seed=3)
        check(x, w, 17, implementation=IMPLEMENTATIONS[implementation])


@pytest.mark.parametrize("implementation", ALL)
def test_non_finite_rows(implementation):
    # Row 0: NaN hidden state; row 1: a +inf logit (bias); rows 2-3: -inf logits (probability 0), fewer finite
    # ones than k in row 3; row 4: every logit -inf; rows 5-6: clean.
    v, d, k = 40, 6, 8
    x, w = problem(7, v, d, seed=4)
    bias = torch.zeros(v)
    x[0, 2] = math.nan
    bias_rows = torch.zeros(7, v)
    bias_rows[1, 7] = math.inf
    bias_rows[2, ::3] = -math.inf
    bias_rows[3, 5:] = -math.inf  # five finite logits, k = 8
    bias_rows[4, :] = -math.inf
    # one bias per row: the rows one at a time (the op takes one bias for all rows)
    outs = [IMPLEMENTATIONS[implementation](x[i:i + 1], w, k, bias=bias + bias_rows[i], return_stats=True)
            for i in range(7)]
    for i, (lp, ids, lse, ent) in enumerate(outs):
        ref_lp, ref_ids, ref_lse, ref_ent = reference.topk_logprobs(x[i:i + 1], w, k, bias=bias + bias_rows[i])
        if i in (0, 1, 4):
            assert lp.isnan().all() and lse.isnan().all() and ent.isnan().all(), i
            assert torch.equal(ids[0], torch.arange(k)), i
            continue
        assert torch.equal(ids, ref_ids), i
        torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5, equal_nan=False)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-5)
    lp3, ids3 = outs[3][0][0], outs[3][1][0]
    assert (lp3[5:] == -math.inf).all() and torch.equal(ids3[5:], torch.tensor([5, 6, 7]))
    check(x[5:], w, k, implementation=IMPLEMENTATIONS[implementation], bias=bias)


def test_every_row_of_a_batch_at_once():
    # NaN and -inf rows among clean ones, in one call: clean rows are unaffected.
    x, w = problem(6, 300, 12, seed=5)
    x[1, 0] = math.nan
    x[4] = math.inf  # inf * w: +inf and -inf logits, NaN where w is 0 -> no distribution
    check(x, w, 10)


def test_k_equal_to_the_vocabulary():
    x, w = problem(4, 30, 5, dtype=torch.float64, seed=10)
    lp, ids = check(x, w, 30)
    assert torch.equal(ids.sort(-1).values, torch.arange(30).expand(4, 30))


def test_empty_and_single_rows():
    x, w = problem(0, 50, 4)
    lp, ids, lse, ent = nitrobrew.topk_logprobs(x, w, 3, return_stats=True)
    assert lp.shape == ids.shape == (0, 3) and lse.shape == (0,)
    x, w = problem(1, 1, 4)
    lp, ids = nitrobrew.topk_logprobs(x[0], w, 1)
    assert ids.tolist() == [0] and lp.tolist() == [0.0]


def test_the_maximum_k_and_many_vocabulary_tiles():
    x, w = problem(5, 3000, 8, scale=2.0, seed=6)
    op_in_tiles = functools.partial(nitrobrew.topk_logprobs, chunk_V=129)
    check(x, w, nitrobrew.topk_logprobs.MAX_K, implementation=op_in_tiles)
    check(x, w, 300, implementation=chunked)


@pytest.mark.parametrize("bad, match, error", [
    (dict(k=0), "k must be in", ValueError),
    (dict(k=51), "k must be in", ValueError),
    (dict(k=True), "k must be an integer", TypeError),
    (dict(k=2.0), "k must be an integer", TypeError),
    (dict(temperature=0.0), "temperature must be a positive", ValueError),
    (dict(logit_scale=-1.0), "logit_scale must be a positive", ValueError),
    (dict(softcap=math.inf), "softcap must be a positive", ValueError),
    (dict(vocab_size=51), "vocab_size must be at most", ValueError),
    (dict(bias=torch.zeros(49)), "bias must be", ValueError),
    (dict(w=torch.zeros(50, 5)), "x must be", ValueError),
    (dict(x=torch.zeros(3, 50)), "for logits, use nitrobrew.logits", ValueError),
    (dict(w=torch.zeros(50, 4, dtype=torch.float64)), "share one dtype", TypeError),
    (dict(x=torch.zeros(3, 4, dtype=torch.int64)), "x must be float32", TypeError),
    (dict(chunk_V=0), "chunk_V must be", ValueError),
])
def test_bad_input_raises_naming_the_argument(bad, match, error):
    args = dict(x=torch.zeros(3, 4), w=torch.zeros(50, 4), k=5)
    args.update(bad)
    with pytest.raises(error, match=match):
        nitrobrew.topk_logprobs(args.pop("x"), args.pop("w"), args.pop("k"), **args)


def test_k_past_the_maximum():
    x, w = problem(2, 1100, 4)
    with pytest.raises(ValueError, match=r"k must be in \[1, min\(vocab_size, 1024\)\]"):
        nitrobrew.topk_logprobs(x, w, 1025)
    with pytest.raises(RuntimeError, match="k must be in"):  # the op's own check
        torch.ops.nitrobrew.topk_logprobs(x, w, 1025, None, 1.0, None, 1.0, 1100, 0)


def test_no_gradients_flow():
    x, w = problem(4, 60, 5)
    x.requires_grad_()
    lp, ids = nitrobrew.topk_logprobs(x, w, 3)
    assert not lp.requires_grad


def test_torch_compile_fullgraph():
    x, w = problem(9, 211, 8, seed=7)
    bias = torch.randn(211)

    def fn(x, w, bias):
        lp, ids, lse, ent = nitrobrew.topk_logprobs(x, w, 6, bias=bias, temperature=2.0, return_stats=True)
        return lp.exp().sum(-1), ids, lse + ent

    eager = fn(x, w, bias)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, w, bias)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lines_up_with_topk_kl():
    # The teacher's top-K from topk_logprobs scores as nitrobrew.topk_kl's teacher: against the student, the
    # loss equals the reference top-K loss with the teacher's exact log-probabilities.
    xs, ws = problem(11, 400, 8, seed=8)
    xt, wt = problem(11, 400, 12, seed=9, scale=2.0)
    lp, ids = nitrobrew.topk_logprobs(xt, wt, 16)
    loss = nitrobrew.topk_kl(xs, ws, ids, lp)
    ref_lp, ref_ids, _, _ = reference.topk_logprobs(xt, wt, 16)
    expected = reference.topk_linear(xs, ws, ref_ids, ref_lp, reduction="mean")
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_against_the_reference(dtype):
    x, w = problem(300, 5003, 64, dtype=dtype, device="cuda", scale=2.0)
    bias = torch.randn(5003, device="cuda", dtype=dtype)
    for k in (1, 32, 256, 1024):
        check(x, w, k, bias=bias, temperature=0.8, vocab_size=4999)
        if os.environ.get("NITROBREW_DEV_KNOBS") == "1":  # the walk, forced
            with walk(WALK):
                check(x, w, k, bias=bias, temperature=0.8, vocab_size=4999)
    lp, ids = nitrobrew.topk_logprobs(x, w, 32)
    cpu_lp, cpu_ids = nitrobrew.topk_logprobs(x.cpu(), w.cpu(), 32)
    torch.testing.assert_close(lp.cpu(), cpu_lp, rtol=0, atol=1e-4)


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_walk_on_a_real_vocabulary(dtype):
    # 16-bit inputs and a 40000-token vocabulary: the walk serves k <= 32 by default (a sample of 2048 columns),
    # the row path k = 128.
    x, w = problem(150, 40000, 64, dtype=dtype, device="cuda", scale=4.0, seed=7)
    bias = torch.randn(40000, device="cuda", dtype=dtype)
    for k in (1, 8, 32, 128):
        check(x, w, k, bias=bias, temperature=0.9)
    check(x, w, 32, softcap=20.0, logit_scale=1.5, vocab_size=39999)


def cuda_kernels(fn):
    """The names of the CUDA kernels fn() launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@CUDA
def test_cuda_path_choice():
    # The walk (its selection kernel) for 16-bit inputs at k <= 32 on a vocabulary of 8192 or more; the row kernel
    # alone otherwise. So that the walk's tests cannot pass on the row path.
    x, w = problem(64, 40000, 32, dtype=torch.bfloat16, device="cuda", seed=9)

    def walked(x, w, k):
        return any("topk_candidates_kernel" in name for name in cuda_kernels(lambda: nitrobrew.topk_logprobs(x, w, k)))

    assert walked(x, w, 8) and walked(x, w, 32)
    assert not walked(x, w, 33) and not walked(x.float(), w.float(), 8) and not walked(x[:, :], w[:8000], 8)


@CUDA
@DEV_BUILD
def test_cuda_walk_overflow_takes_the_row_path():
    # Lists of 48 entries at a sample of 16 columns: most rows overflow, and the row kernel redoes them after the
    # threshold's own launch; forced off, the walk's kernels do not run.
    x, w = problem(40, 3000, 16, dtype=torch.bfloat16, device="cuda", scale=2.0, seed=10)
    with walk(WALK_OVERFLOWING):
        names = cuda_kernels(lambda: nitrobrew.topk_logprobs(x, w, 5))
        check(x, w, 5)
    assert any("topk_candidates_kernel" in n for n in names)
    assert sum("topk_rows_kernel" in n for n in names) == 2
    with walk("off"):
        names = cuda_kernels(lambda: nitrobrew.topk_logprobs(x, w, 5))
    assert not any("topk_candidates_kernel" in n for n in names)


@CUDA
def test_cuda_graph_capture():
    # The walk reads its flags on the host, which a stream being captured cannot: captured, the op takes the row
    # path, and the graph's replay gives the eager outputs.
    x, w = problem(64, 40000, 32, dtype=torch.bfloat16, device="cuda", seed=11)
    eager = nitrobrew.topk_logprobs(x, w, 8)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        nitrobrew.topk_logprobs(x, w, 8)  # warm-up on a side stream, as torch.cuda.graphs asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nitrobrew.topk_logprobs(x, w, 8)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured[0], eager[0], rtol=0, atol=1e-4)
    assert (captured[1] == eager[1]).float().mean() > 0.99  # the paths' products may swap near-ties


@CUDA
@DEV_BUILD
def test_cuda_walk_in_several_chunks_of_rows():
    # Lists of 16384 entries a row: 4094 rows a chunk of 512 MiB, so 9000 rows take three chunks.
    x, w = problem(9000, 2000, 16, dtype=torch.bfloat16, device="cuda", scale=3.0, seed=8)
    with walk("64:16384"):
        check(x, w, 12)
    with walk("off"):
        check(x, w, 12)


@CUDA
def test_cuda_float64_raises():
    x, w = problem(3, 50, 4, dtype=torch.float64, device="cuda")
    with pytest.raises(TypeError, match="float64 inputs are supported on the CPU only"):
        nitrobrew.topk_logprobs(x, w, 3)
