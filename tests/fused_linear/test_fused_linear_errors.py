"""Bad input gives a clear error that names the argument."""

import inspect

import numpy as np

import pytest
import torch

import nitrobrew
from helpers import make_problem


@pytest.fixture
def problem():
    return make_problem(n=6, v=50, d_s=8, d_t=12)


def call(problem, fn=nitrobrew.forward_kl, **overrides):
    xs, xt, ws, wt, labels = problem
    args = dict(xs=xs, xt=xt, ws=ws, wt=wt)
    options = {k: v for k, v in overrides.items() if k not in args}
    args.update({k: v for k, v in overrides.items() if k in args})
    return fn(args["xs"], args["xt"], args["ws"], args["wt"], **options)


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(ws=torch.randn(50, 8, 1)), ValueError, "ws and wt must be \\[V, D\\] matrices"),
        (dict(xs=torch.randn(())), ValueError, "xs and xt must be \\[..., D\\]"),
        (dict(xt=torch.randn(5, 12)), ValueError, "same leading shape"),
        (dict(ws=torch.randn(50, 7)), ValueError, "ws must be \\[V, D_s\\]"),
        (dict(xs=torch.randn(6, 50)), ValueError, "vocabulary size V = 50: for logits, use nitrobrew.logits"),
        (dict(ws=torch.randn(8, 50)), ValueError, r"a \[D, V\] matrix\? it must be \[V, D\], as lm_head.weight is"),
        (dict(wt=torch.randn(50, 8)), ValueError, "wt must be \\[V, D_t\\]"),
        (dict(wt=torch.randn(49, 12)), ValueError, "pass vocab_size="),
        (dict(vocab_size=51), ValueError, "vocab_size must be at most"),
        (dict(vocab_size=0), ValueError, "vocab_size must be a positive integer"),
        (dict(ws=torch.randn(50, 8, dtype=torch.float64)), TypeError, "share one dtype"),
        (dict(xt=torch.randn(6, 12, dtype=torch.bfloat16)), TypeError, "share one dtype"),
        (dict(xs=torch.randint(0, 3, (6, 8))), TypeError, "xs must be float32"),
        (dict(xs=[[0.0] * 8] * 6), TypeError, "xs must be a torch.Tensor"),
        (dict(ws=torch.randn(50, 8, device="meta")), ValueError, "one device"),
        (dict(temperature=0.0), ValueError, "temperature must be a positive"),
        (dict(temperature=-1.0), ValueError, "temperature must be a positive"),
        (dict(temperature=float("inf")), ValueError, "temperature must be a positive"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(labels=torch.zeros(6, dtype=torch.int32)), TypeError, "labels must be an int64"),
        (dict(labels=torch.zeros(5, dtype=torch.int64)), ValueError, "labels must have the leading shape"),
        (dict(labels=torch.zeros(6, 1, dtype=torch.int64)), ValueError, "labels must have the leading shape"),
        (dict(ce_weight=0.5), ValueError, "needs labels"),
        (dict(ce_weight=-0.5), ValueError, "ce_weight must be a non-negative"),
        (dict(softcap_s=0.0), ValueError, "softcap_s must be a positive"),
        (dict(softcap_t=-3.0), ValueError, "softcap_t must be a positive"),
        (dict(chunk_V=0), ValueError, "chunk_V must be a positive integer"),
        (dict(chunk_V=2.5), ValueError, "chunk_V must be a positive integer"),
        (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (dict(bias_s=torch.zeros(49)), ValueError, r"bias_s must be \[V\] with one entry per row of ws \(50\)"),
        (dict(bias_t=torch.zeros(50, 1)), ValueError, r"bias_t must be \[V\] with one entry per row of wt"),
        (dict(bias_s=torch.zeros(50, dtype=torch.int64)), TypeError, "bias_s must be float32"),
        (dict(bias_s=torch.zeros(50, device="meta")), ValueError, "bias_s must be on ws's device"),
        (dict(logit_scale_s=0.0), ValueError, "logit_scale_s must be a positive"),
        (dict(logit_scale_t=float("nan")), ValueError, "logit_scale_t must be a positive"),
    ],
)
def test_bad_arguments(problem, overrides, error, match):
    with pytest.raises(error, match=match):
        call(problem, **overrides)


@pytest.mark.parametrize("beta", [-0.1, 1.5, float("nan")])
def test_beta_outside_unit_interval(problem, beta):
    with pytest.raises(ValueError, match="beta must be a number in \\[0, 1\\]"):
        call(problem, fn=nitrobrew.jsd, beta=beta)


@pytest.mark.parametrize("fn, name", [(nitrobrew.jsd, "beta"), (nitrobrew.skew_forward_kl, "alpha"),
                                      (nitrobrew.skew_reverse_kl, "alpha"), (nitrobrew.logits.jsd, "beta")])
def test_denormal_mixture_weight(problem, fn, name):
    # float32 holds the weight in the kernels: below its smallest normal number the CUDA kernels' log would flush it
    with pytest.raises(ValueError, match=f"{name} must be 0 or at least 1.17549"):
        if fn is nitrobrew.logits.jsd:
            fn(torch.randn(3, 7), torch.randn(3, 7), beta=1e-40)
        else:
            call(problem, fn=fn, **{name: 1e-40})


def test_label_out_of_vocabulary_with_cross_entropy(problem):
    labels = torch.tensor([0, 1, 2, 50, -100, 3])
    with pytest.raises(IndexError, match=r"labels\[3\] = 50 is outside \[0, V = 50\)"):
        call(problem, labels=labels, ce_weight=1.0)
    # Without the cross-entropy add-on labels only mask, so any value is accepted.
    assert torch.isfinite(call(problem, labels=labels))


def test_label_past_vocab_size_of_padded_weights():
    xs, xt, ws, wt, _ = make_problem(n=3, v=40, d_s=8, d_t=12, rows_s=48, rows_t=44)
    labels = torch.tensor([0, 41, 39])
    with pytest.raises(IndexError, match=r"labels\[1\] = 41 is outside \[0, V = 40\)"):
        nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, ce_weight=1.0, vocab_size=40)


def test_op_checks_its_inputs_when_called_directly(problem):
    xs, xt, ws, wt, labels = problem
    with pytest.raises(RuntimeError, match="temperature must be a positive number"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, None, None, -100, "forward_kl", 0.0, 0.0, 0.0,
                                             None, None, 1.0, 1.0, 50, 0)
    with pytest.raises(RuntimeError, match="vocab_size must be in"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, None, None, -100, "forward_kl", 0.0, 1.0, 0.0,
                                             None, None, 1.0, 1.0, 51, 0)
    with pytest.raises(RuntimeError, match="row_stats must be"):
        torch.ops.nitrobrew.fused_linear_bwd(
            torch.ones(6), xs, xt, ws, wt, None, None, None, torch.zeros(6, 5), -100, "forward_kl", 0.0, 1.0, 0.0, None,
            None, 1.0, 1.0, 50, 0, True, True, True,
        )
    with pytest.raises(RuntimeError, match="divergence must be 'forward_kl', 'reverse_kl', 'jsd', 'skew_forward_kl', 'skew_reverse_kl' or 'tvd', got 'kl'"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, None, None, -100, "kl", 0.0, 1.0, 0.0, None, None,
                                             1.0, 1.0, 50, 0)
    with pytest.raises(RuntimeError, match=r"bias_s must be \[V\] with one entry per row of ws \(50\)"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, torch.zeros(49), None, -100, "forward_kl", 0.0, 1.0,
                                             0.0, None, None, 1.0, 1.0, 50, 0)
    with pytest.raises(RuntimeError, match="bias_t must have wt's dtype"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, None, torch.zeros(50, dtype=torch.float64), -100,
                                             "forward_kl", 0.0, 1.0, 0.0, None, None, 1.0, 1.0, 50, 0)
    with pytest.raises(RuntimeError, match="logit_scale_t must be a positive number"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, None, None, -100, "forward_kl", 0.0, 1.0, 0.0, None,
                                             None, 1.0, -2.0, 50, 0)
    with pytest.raises(RuntimeError, match="beta must be in"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, None, None, -100, "jsd", 1.5, 1.0, 0.0, None, None,
                                             1.0, 1.0, 50, 0)
    with pytest.raises(RuntimeError, match="beta must be 0 or at least"):
        torch.ops.nitrobrew.fused_linear_fwd(xs, xt, ws, wt, None, None, None, -100, "jsd", 1e-40, 1.0, 0.0, None,
                                             None, 1.0, 1.0, 50, 0)


@pytest.mark.parametrize("fn", [nitrobrew.forward_kl, nitrobrew.reverse_kl, nitrobrew.logits.forward_kl,
                                nitrobrew.logits.reverse_kl])
def test_the_kls_take_no_beta(problem, fn):
    # beta is jsd's mixture weight: a KL given one is told so, not silently ignored.
    xs, xt, ws, wt, labels = problem
    args = (xs, xt, ws, wt) if fn.__module__ == "nitrobrew.fused_linear" else (xs @ ws.T, xt @ wt.T)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beta'"):
        fn(*args, beta=0.3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        fn(*args, temprature=2.0)


def test_the_three_functions_share_one_signature_and_document_it():
    for module in (nitrobrew.fused_linear, nitrobrew.logits):
        kl, jsd = inspect.signature(module.forward_kl), inspect.signature(module.jsd)
        assert "beta" not in kl.parameters and jsd.parameters["beta"].default == 0.5
        assert [p for p in jsd.parameters if p != "beta"] == list(kl.parameters)
        assert inspect.signature(module.reverse_kl) == kl
        for fn in (module.forward_kl, module.reverse_kl, module.jsd):
            assert fn.__module__ == module.__name__ and "temperature" in fn.__doc__


def test_numbers_may_be_0d_tensors_or_numpy_scalars(problem):
    xs, xt, ws, wt, labels = make_problem(n=6, v=50, d_s=8, d_t=12, masked=True)
    expected = nitrobrew.jsd(xs, xt, ws, wt, beta=0.25, temperature=2.0, labels=labels, ignore_index=-100,
                             ce_weight=0.5, softcap_s=30.0, vocab_size=48, chunk_V=16)
    got = nitrobrew.jsd(xs, xt, ws, wt, beta=torch.tensor(0.25), temperature=np.float32(2.0), labels=labels,
                        ignore_index=np.int64(-100), ce_weight=torch.tensor(0.5, dtype=torch.float64),
                        softcap_s=np.float64(30.0), vocab_size=torch.tensor(48), chunk_V=np.int32(16))
    torch.testing.assert_close(got, expected)
    with pytest.raises(TypeError, match="ignore_index must be an integer"):
        nitrobrew.forward_kl(xs, xt, ws, wt, ignore_index=torch.tensor(-100.0))
    with pytest.raises(ValueError, match="temperature must be a positive finite number"):
        nitrobrew.forward_kl(xs, xt, ws, wt, temperature=torch.ones(2))


def test_empty_sizes_are_named(problem):
    xs, xt, ws, wt, _ = problem
    with pytest.raises(ValueError, match="hidden size D >= 1"):
        nitrobrew.forward_kl(xs[:, :0], xt, ws[:, :0], wt)
    with pytest.raises(ValueError, match="at least one vocabulary row"):
        nitrobrew.forward_kl(xs, xt, ws[:0], wt[:0])
    with pytest.raises(ValueError, match="D >= 1"):
        nitrobrew.topk_kl(xs[:, :0], ws[:, :0], torch.zeros(6, 2, dtype=torch.int64), torch.zeros(6, 2))


def test_meta_tensors_go_through_the_fake_kernels():
    # Shape inference without data (as torch.compile's tracing and model summaries do): no kernel runs.
    meta = dict(device="meta")
    xs, xt = torch.empty(2, 7, 8, **meta), torch.empty(2, 7, 12, **meta)
    ws, wt = torch.empty(50, 8, **meta), torch.empty(50, 12, **meta)
    ids, lps = torch.empty(2, 7, 5, dtype=torch.int64, **meta), torch.empty(2, 7, 5, **meta)
    assert nitrobrew.jsd(xs, xt, ws, wt, reduction="none").shape == (2, 7)
    assert nitrobrew.forward_kl(xs, xt, ws, wt).shape == ()
    assert nitrobrew.topk_kl(xs, ws, ids, lps, reduction="none").shape == (2, 7)
    zs = torch.empty(2, 7, 50, **meta)
    assert nitrobrew.logits.reverse_kl(zs, zs, reduction="none").shape == (2, 7)
    assert nitrobrew.logits.topk_kl(zs, ids, lps).device.type == "meta"
    q, k = torch.empty(2, 9, 4, 16, **meta), torch.empty(2, 11, 2, 16, **meta)
    assert nitrobrew.attention_kl(q, k, q, k, causal=True, reduction="none").shape == (2, 4, 9)


def test_an_empty_weight_points_at_zero3():
    xs, xt, ws, wt, _ = make_problem(n=4, v=10)
    with pytest.raises(ValueError, match="ZeRO-3"):  # a partitioned ZeRO-3 parameter's placeholder
        nitrobrew.forward_kl(xs, xt, torch.empty(0), wt)
