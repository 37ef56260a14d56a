"""Values and gradients of the fused-linear losses against the float64 reference."""

import itertools

import pytest
import torch

import nitrobrew
from nitrobrew import reference

from helpers import NEW_DIVERGENCES, check_against_reference, make_biases, make_problem, nitrobrew_loss
from randomized import loss_floor

KLS_AND_JSD = [0.0, 1.0, 0.5]  # forward KL, reverse KL, JSD
BETAS = KLS_AND_JSD + NEW_DIVERGENCES  # and the skew KLs and TVD, (name, weight) pairs (helpers.py)


# Each reduction on each path: "none" runs the recompute path only (grad_in_forward False); "sum" and
# "mean" run the training path (True) and the recompute path (False).
PATHS = [("none", False), ("sum", True), ("sum", False), ("mean", True), ("mean", False)]


def training_path(reduction):
    """The training path for a scalar loss; "none" has the recompute path alone."""
    return None if reduction == "none" else True


# Every combination for the KLs and JSD; for the other divergences, whose kernels are the same but for their
# per-entry terms, each path with options off, all on, and two mixes.
@pytest.mark.parametrize(
    "beta,path,masked,ce_weight,softcap,padded",
    list(itertools.product(KLS_AND_JSD, PATHS, [False, True], [0.0, 0.5], [False, True], [False, True]))
    + [(beta, path, *options) for beta, path, options in itertools.product(
        NEW_DIVERGENCES, PATHS, [(False, 0.0, False, False), (True, 0.5, True, True), (True, 0.0, False, True),
                                 (False, 0.5, True, False)])],
)
def test_every_option(device, beta, path, masked, ce_weight, softcap, padded):
    # V = 1000 over tiles of 96: neither N = 37 nor V divides a tile. On the training path a 1 MiB
    # budget cuts the 37 tokens into chunks of products and of dLoss/dz.
    reduction, grad_in_forward = path
    rows = 1024 if padded else None
    xs, xt, ws, wt, labels = make_problem(device=device, masked=masked, rows_s=rows, rows_t=rows)
    options = dict(reduction=reduction, labels=labels if masked or ce_weight else None, ce_weight=ce_weight,
                   temperature=1.5, vocab_size=1000 if padded else None)
    if softcap:
        options.update(softcap_s=4.0, softcap_t=6.0)
    check_against_reference(xs, xt, ws, wt, beta=beta, chunk_V=96, grad_in_forward=grad_in_forward, grad_chunk_mib=1,
                            **options)


# How real models turn hidden states into logits: an lm_head bias (Phi, GPT-J, ...), a logit
# multiplier before any soft-cap (Cohere's logit_scale 0.0625, Granite's 1 / logits_scaling), both with
# Gemma's soft-cap, and the two models differing.
MODELS = {
    "bias": dict(bias=(True, True)),
    "student_bias": dict(bias=(True, False)),
    "scale": dict(logit_scale_s=0.0625, logit_scale_t=2.5),
    "bias_scale_softcap": dict(bias=(True, True), logit_scale_s=0.5, logit_scale_t=1.7, softcap_s=4.0,
                               softcap_t=6.0),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("masked,ce_weight,padded", [(False, 0.0, False), (True, 0.5, True)])
@pytest.mark.parametrize("reduction", ["none", "mean"])  # the recompute path, then the training path
def test_bias_and_logit_scale(device, model, beta, masked, ce_weight, padded, reduction):
    rows = 1024 if padded else None
    xs, xt, ws, wt, labels = make_problem(device=device, masked=masked, rows_s=rows, rows_t=rows)
    options = dict(MODELS[model])
    bias_s, bias_t = make_biases(ws, wt, scale=2.0)
    use_s, use_t = options.pop("bias", (False, False))
    options.update(bias_s=bias_s if use_s else None, bias_t=bias_t if use_t else None)
    check_against_reference(xs, xt, ws, wt, beta=beta, chunk_V=96, reduction=reduction, temperature=1.5,
                            grad_in_forward=training_path(reduction),
                            labels=labels if masked or ce_weight else None, ce_weight=ce_weight,
                            vocab_size=1000 if padded else None, **options)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature,logit_scale", [(0.1, 1.5), (10.0, 0.05)])
@pytest.mark.parametrize("reduction", ["none", "sum"])  # the recompute path, then the training path
def test_bias_and_logit_scale_at_extreme_temperatures(device, beta, temperature, logit_scale, reduction):
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    bias_s, bias_t = make_biases(ws, wt)
    options = dict(bias_s=bias_s, bias_t=bias_t, logit_scale_s=logit_scale, logit_scale_t=1 / logit_scale)
    # The student's scaled logits reach ~200 at T = 0.1: a one-pass loss keeps float32's rounding of
    # them (tests/randomized.py loss_floor).
    size = reference.model_logits(xs.double(), ws.double(), bias=bias_s.double(), logit_scale=logit_scale)
    floor = loss_floor(xs.dtype, size.abs().max().item() / temperature, ws.shape[0], xs.shape[0], reduction)
    check_against_reference(xs, xt, ws, wt, beta=beta, temperature=temperature, labels=labels, ce_weight=0.3,
                            reduction=reduction, loss_floor=floor, grad_in_forward=training_path(reduction), **options)


def test_bias_and_logit_scale_equal_the_logits_they_define():
    # The options are exactly the transform written out: the same loss as nitrobrew.logits on
    # softcap(scale * (x @ w.T + b)) materialized (small sizes, float64 on the CPU), and bias_t gets
    # no gradient.
    xs, xt, ws, wt, labels = make_problem(n=9, v=50, dtype=torch.float64, masked=True)
    bias_s, bias_t = (b.requires_grad_() for b in make_biases(ws, wt))
    kwargs = dict(labels=labels, temperature=0.7, reduction="sum")
    fused = nitrobrew.jsd(xs, xt, ws, wt, beta=0.3, bias_s=bias_s, bias_t=bias_t, logit_scale_s=0.3,
                          logit_scale_t=2.0, softcap_s=5.0, **kwargs)
    zs = 5.0 * torch.tanh(0.3 * (xs @ ws.T + bias_s) / 5.0)
    zt = 2.0 * (xt @ wt.T + bias_t)
    materialized = nitrobrew.logits.jsd(zs, zt, beta=0.3, **kwargs)
    torch.testing.assert_close(fused, materialized, rtol=1e-12, atol=1e-12)
    (grad_fused,) = torch.autograd.grad(fused, bias_s)
    (grad_materialized,) = torch.autograd.grad(materialized, bias_s)
    torch.testing.assert_close(grad_fused, grad_materialized, rtol=1e-10, atol=1e-12)
    nitrobrew.forward_kl(xs, xt, ws, wt, bias_t=bias_t, **kwargs).backward()
    assert bias_t.grad is None, "bias_t is the teacher's: no gradient"


@pytest.mark.parametrize("beta", [1e-3, 0.1, 0.9, 0.999, 1 - 1e-6])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_jsd_beta_near_endpoints(device, beta, reduction):
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, reduction=reduction, chunk_V=128,
                            grad_in_forward=training_path(reduction))


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [0.1, 0.5, 2.0, 10.0])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_temperatures(device, beta, temperature, reduction):
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    check_against_reference(xs, xt, ws, wt, beta=beta, temperature=temperature, labels=labels, ce_weight=0.3,
                            reduction=reduction, grad_in_forward=training_path(reduction))


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_logits_of_magnitude_1e4_are_finite_and_correct(device, beta, reduction):
    # Hidden states scaled so that logits reach ~1e4: distributions are near one-hot and the
    # float32 log-normalizers are ~1e4, so only relative accuracy is meaningful.
    xs, xt, ws, wt, labels = make_problem(n=19, v=700, device=device, scale=3000.0, masked=True)
    (loss, dxs, dws), _ = check_against_reference(
        xs, xt, ws, wt, beta=beta, labels=labels, reduction=reduction, ce_weight=0.1, chunk_V=64,
        grad_in_forward=training_path(reduction),
    )
    assert loss.abs().max() > 10, "the test should reach large losses"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["none", "sum"])  # the recompute path, then the training path
def test_dtypes(device, dtype, beta, reduction):
    if device == "cpu" or dtype != torch.float64:
        xs, xt, ws, wt, labels = make_problem(dtype=dtype, device=device, masked=True)
        # float64 inputs are accumulated in float64: hold them to a float64 tolerance.
        rel_floor = 1e-12 if dtype == torch.float64 else 1e-6
        check_against_reference(xs, xt, ws, wt, beta=beta, labels=labels, reduction=reduction, ce_weight=0.2,
                                rel_floor=rel_floor, grad_in_forward=training_path(reduction))


@pytest.mark.parametrize("chunk_V", [1, 7, 96, 999, 1000, 4096, None])
def test_vocab_tile_widths(device, chunk_V):
    xs, xt, ws, wt, labels = make_problem(n=13, device=device, masked=True)
    check_against_reference(xs, xt, ws, wt, beta=0.5, labels=labels, reduction="sum", ce_weight=0.2,
                            chunk_V=chunk_V)


def test_several_default_tiles_and_row_chunks(device):
    # V = 2500 spans three default tiles (1024); 2^22 / 1024 = 4096 rows per chunk, so
    # N = 4100 spans two row chunks.
    xs, xt, ws, wt, labels = make_problem(n=4100, v=2500, d_s=8, d_t=12, device=device, masked=True)
    check_against_reference(xs, xt, ws, wt, beta=1.0, labels=labels, reduction="mean", ce_weight=0.2)


def test_leading_shape_and_per_token_weights(device):
    xs, xt, ws, wt, labels = make_problem(lead=(3, 13), device=device, masked=True)
    weights = torch.rand(3, 13, dtype=torch.float64, device=device)  # e.g. per-token RL advantages
    (loss, dxs, _), _ = check_against_reference(
        xs, xt, ws, wt, beta=0.5, labels=labels, reduction="none", upstream=weights
    )
    assert loss.shape == (3, 13) and dxs.shape == xs.shape
    assert (loss[labels == -100] == 0).all()


def test_single_token(device):
    xs, xt, ws, wt, labels = make_problem(n=1, device=device)
    check_against_reference(xs, xt, ws, wt, beta=0.0, reduction="mean", labels=labels, ce_weight=1.0)


def test_non_contiguous_inputs(device):
    xs, xt, ws, wt, labels = make_problem(n=40, d_s=48, d_t=40, device=device, masked=True)
    xs = xs[::2, ::2]                          # [20, 24], strided both ways
    xt = xt.T.contiguous().T[::2]              # [20, 40], column-major
    ws = ws[:, 1::2]                           # [1000, 24], row stride 48
    wt = wt.T.contiguous().T                   # column-major
    labels = labels[::2]
    assert not (xs.is_contiguous() or xt.is_contiguous() or ws.is_contiguous() or wt.is_contiguous())
    check_against_reference(xs, xt, ws, wt, beta=0.5, labels=labels, reduction="none", ce_weight=0.5)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_no_tokens(device, reduction):
    xs, xt, ws, wt, _ = make_problem(n=0, device=device)
    xs.requires_grad_()
    ws.requires_grad_()
    loss = nitrobrew_loss(xs, xt, ws, wt, beta=0.5, reduction=reduction)
    assert loss.shape == ((0,) if reduction == "none" else ())
    assert torch.isfinite(loss).all() and (loss == 0).all()
    loss.sum().backward()
    assert xs.grad.shape == xs.shape and (ws.grad == 0).all()


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_all_tokens_masked(device, beta, reduction):
    xs, xt, ws, wt, labels = make_problem(n=9, device=device)
    labels = torch.full_like(labels, -7)
    xs.requires_grad_()
    ws.requires_grad_()
    loss = nitrobrew_loss(xs, xt, ws, wt, beta=beta, reduction=reduction, labels=labels, ignore_index=-7,
                          ce_weight=0.5)
    assert torch.isfinite(loss).all() and (loss == 0).all()
    loss.sum().backward()
    assert (xs.grad == 0).all() and (ws.grad == 0).all()


def test_mean_is_sum_over_unmasked_tokens(device):
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    per_token = nitrobrew_loss(xs, xt, ws, wt, beta=0.0, labels=labels, reduction="none")
    mean = nitrobrew_loss(xs, xt, ws, wt, beta=0.0, labels=labels, reduction="mean")
    batchmean = nitrobrew_loss(xs, xt, ws, wt, beta=0.0, labels=labels, reduction="batchmean")
    valid = (labels != -100).sum()
    torch.testing.assert_close(mean, per_token.sum() / valid)
    torch.testing.assert_close(batchmean, mean)


@pytest.mark.parametrize("grad_of", ["xs", "ws"])
def test_gradient_to_one_input_only(device, grad_of):
    # Frozen unembedding (LoRA) or frozen body: the other gradient is neither needed nor computed.
    xs, xt, ws, wt, labels = make_problem(device=device)
    full_xs, full_ws = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    nitrobrew_loss(full_xs, xt, full_ws, wt, beta=1.0).backward()
    target = (xs if grad_of == "xs" else ws).requires_grad_()
    nitrobrew_loss(xs, xt, ws, wt, beta=1.0).backward()
    torch.testing.assert_close(target.grad, full_xs.grad if grad_of == "xs" else full_ws.grad)
    other = ws if grad_of == "xs" else xs
    assert other.grad is None


def test_teacher_receives_no_gradient(device):
    xs, xt, ws, wt, _ = make_problem(device=device)
    for t in (xs, xt, ws, wt):
        t.requires_grad_()
    nitrobrew_loss(xs, xt, ws, wt, beta=0.5).backward()
    assert xt.grad is None and wt.grad is None
    assert xs.grad is not None and ws.grad is not None


def test_teacher_from_inference_mode(device):
    # A teacher run under torch.inference_mode gives inference tensors, which autograd cannot save.
    xs, xt, ws, wt, _ = make_problem(device=device)
    with torch.inference_mode():
        xt_inference = xt.clone()
    xs.requires_grad_()
    nitrobrew_loss(xs, xt_inference, ws, wt, beta=0.5).backward()
    expected = xs.detach().clone().requires_grad_()
    nitrobrew_loss(expected, xt, ws, wt, beta=0.5).backward()
    torch.testing.assert_close(xs.grad, expected.grad)


def test_under_autocast(device):
    # As HF Trainer(bf16=True) runs it: bf16 activations, float32 lm_head weights.
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    ws.requires_grad_()
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        loss = nitrobrew_loss(xs.bfloat16(), xt.bfloat16(), ws, wt, beta=1.0, labels=labels)
    loss.backward()
    expected = nitrobrew_loss(xs.bfloat16(), xt.bfloat16(), ws.detach().bfloat16(), wt.bfloat16(), beta=1.0,
                              labels=labels)
    torch.testing.assert_close(loss, expected)
    assert ws.grad is not None and ws.grad.dtype == torch.float32


def test_double_backward_is_a_clear_error(device):
    xs, xt, ws, wt, _ = make_problem(device=device)
    xs.requires_grad_()
    loss = nitrobrew_loss(xs, xt, ws, wt, beta=0.0)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, xs, create_graph=True)


def test_bias_gradient_alone(device):
    # Only bias_s wants a gradient: the backward forms no dxs or dws, and the bias's equals the one
    # computed with them.
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    bias_s, bias_t = make_biases(ws, wt)
    options = dict(beta=0.4, labels=labels, ce_weight=0.2, bias_t=bias_t, logit_scale_s=0.6)
    b_alone = bias_s.clone().requires_grad_()
    nitrobrew.jsd(xs, xt, ws, wt, bias_s=b_alone, **options).backward()
    a, w, b_all = xs.clone().requires_grad_(), ws.clone().requires_grad_(), bias_s.clone().requires_grad_()
    nitrobrew.jsd(a, xt, w, wt, bias_s=b_all, **options).backward()
    assert b_alone.grad.abs().max() > 0
    torch.testing.assert_close(b_alone.grad, b_all.grad)
