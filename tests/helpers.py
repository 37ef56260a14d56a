"""Problem factories and the tolerance rule shared by the tests."""

from __future__ import annotations

import torch

import nitrobrew
from nitrobrew import reference

LOSSES = {0.0: nitrobrew.forward_kl, 1.0: nitrobrew.reverse_kl}

# A test's divergence is a `beta`: 0 forward KL, 1 reverse KL, otherwise JSD(beta); or a (name, weight) pair for
# the others: ("skew_forward_kl", alpha), ("skew_reverse_kl", alpha), ("tvd", 0.0).
NEW_DIVERGENCES = [("skew_forward_kl", 0.1), ("skew_reverse_kl", 0.5), ("tvd", 0.0)]


def divergence_of(beta) -> str:
    """The op's divergence argument for a test's beta: 0 forward KL, 1 reverse KL, else JSD(beta); a pair's name."""
    if isinstance(beta, tuple):
        return beta[0]
    return {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")


def op_weight(beta) -> float:
    """The op's weight argument for a test's beta (the pair's weight: the skew KLs' alpha)."""
    return beta[1] if isinstance(beta, tuple) else beta


def reference_options(beta) -> dict:
    """The reference's (beta, divergence) options for a test's beta."""
    return {"beta": op_weight(beta), "divergence": divergence_of(beta)}


# The top-K losses' (normalize, a test's beta) cases: "full" is forward KL's alone, "topk" takes every divergence.
TOPK_CASES = [("full", 0.0), ("topk", 0.0), ("topk", 1.0), ("topk", 0.3), *(("topk", d) for d in NEW_DIVERGENCES)]


def divergence_kwargs(beta) -> dict:
    """topk_kl's divergence= and weight keywords for a test's beta."""
    return {"divergence": divergence_of(beta), **weight_kwargs(beta)}


def weight_kwargs(beta) -> dict:
    """The public function's weight keyword for a test's beta: {"beta": ...}, {"alpha": ...} or {}."""
    name = divergence_of(beta)
    if name == "jsd":
        return {"beta": op_weight(beta)}
    if name.startswith("skew_"):
        return {"alpha": op_weight(beta)}
    return {}


def nitrobrew_loss(xs, xt, ws, wt, *, beta, module=nitrobrew, **options):
    """The public function for a test's beta: forward_kl (0), reverse_kl (1), jsd (otherwise), or a pair's."""
    if not isinstance(beta, tuple) and beta in LOSSES and module is nitrobrew:
        return LOSSES[beta](xs, xt, ws, wt, **options)
    return getattr(module, divergence_of(beta))(xs, xt, ws, wt, **weight_kwargs(beta), **options)


def make_problem(n=37, v=1000, d_s=24, d_t=40, *, lead=None, scale=3.0, rows_s=None, rows_t=None,
                 dtype=torch.float32, device="cpu", masked=False, seed=0):
    """Random student/teacher hidden states and unembeddings whose logits have std ~ scale.

    rows_s / rows_t pad the weight matrices past v (as padded vocabularies do)."""
    g = torch.Generator().manual_seed(seed)
    lead = (n,) if lead is None else lead
    xs = torch.randn(*lead, d_s, generator=g, dtype=torch.float64)
    xt = torch.randn(*lead, d_t, generator=g, dtype=torch.float64)
    ws = torch.randn(rows_s or v, d_s, generator=g, dtype=torch.float64) * scale / d_s**0.5
    wt = torch.randn(rows_t or v, d_t, generator=g, dtype=torch.float64) * scale / d_t**0.5
    labels = torch.randint(0, v, lead, generator=g)
    if masked:
        drop = torch.rand(lead, generator=g) < 0.3
        labels = torch.where(drop, torch.full_like(labels, -100), labels)
    xs, xt, ws, wt = (t.to(dtype=dtype, device=device) for t in (xs, xt, ws, wt))
    return xs, xt, ws, wt, labels.to(device)


def max_error(actual, oracle):
    return (actual.double() - oracle.double()).abs().max().item() if oracle.numel() else 0.0


def assert_close_to_oracle(actual, oracle64, same_precision, *, k=2.0, rel_floor=1e-6, abs_floor=0.0, slack=None,
                           what=""):
    """|actual - oracle| may be at most k times the error of a plain PyTorch implementation
    evaluated in the precision the kernel accumulates in (STYLE.md habit 10), plus a floor
    relative to the values' magnitude for when that error happens to be ~0, plus abs_floor (the
    rounding floor of a one-pass loss: randomized.py), plus `slack` entry by entry where given (a gradient
    that is discontinuous within rounding of its inputs: tvd_slack)."""
    assert actual.shape == oracle64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(oracle64.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if slack is None:
        err = max_error(actual, oracle64)
    else:
        gap = (actual.double() - oracle64.double()).abs() - slack.to(oracle64.device)
        err = gap.clamp(min=0).max().item() if gap.numel() else 0.0
    # The same-precision result rounded to the output's dtype (gradients come back in the inputs' dtype).
    baseline = max_error(same_precision.to(actual.dtype), oracle64)
    scale = oracle64.abs().max().item() if oracle64.numel() else 0.0
    bound = k * baseline + rel_floor * scale + abs_floor
    assert err <= bound, f"{what}: error {err:.3e} > {k} x same-precision error {baseline:.3e} + {rel_floor * scale:.1e}"


def row_weights(upstream, rows_shape, labels, reduction, ignore_index=-100):
    """d(reduced loss . upstream) / d(row loss): how much each row's loss counts in what autograd differentiates."""
    rows = torch.zeros(rows_shape, dtype=torch.float64, requires_grad=True)
    labels = None if labels is None else labels.cpu()
    reduced = reference._reduce(rows, labels, ignore_index, "mean" if reduction == "batchmean" else reduction)
    (weights,) = torch.autograd.grad(reduced, rows, upstream.cpu().to(torch.float64))
    return weights


def tvd_slack(s, t, row_weight, dtype):
    """How far TVD's gradient with respect to the scaled student logits s [..., V] may lie from the float64 oracle's
    in a kernel's precision, beyond what the float32 reference happens to show, entry by entry (rows weighted by
    row_weight: row_weights). The gradient 1/2 p_u (sign_u - c), c = sum_v sign_v p_v, is linear in the signs:
    - an entry within rounding of a tie (|log p - log q| within a few ulps of the row's logits) may take the other
      side's sign, which moves its own entry by p_v and every entry u by p_u p_v (a flip to or from the
      subgradient 0, half of that);
    - c is a sum of V terms of size up to 1: rounded at 4 ulps of 1, it moves every entry by 2 ulps of p_u, all of
      the gradient of a row whose p is near one-hot (sign_u - c is then ~1 - p_u: seed 2121 of the logits family)."""
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    s, t = s.detach().cpu().double(), t.detach().cpu().double()
    log_p, log_q = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    magnitude = sum(torch.where(x.isfinite(), x, torch.zeros_like(x)).abs().amax(-1, keepdim=True) for x in (s, t))
    gap = (log_p - log_q).abs()
    # An exact float64 tie (equal rows) has sign 0 in the oracle and, by tvd_sign's rule, in the kernels: no slack.
    tie = (gap <= 8 * eps * (magnitude + torch.log(torch.tensor(float(s.shape[-1]))))) & (gap != 0)
    p = log_p.exp()
    tied = torch.where(tie, p, torch.zeros_like(p))
    return row_weight.abs().unsqueeze(-1) * (tied + p * (tied.sum(-1, keepdim=True) + 2 * eps))


def topk_tvd_slack(zs, ids, lps, row_weight, dtype, temperature=1.0):
    """tvd_slack of top-K's normalize="topk" rows (the gathered s = z / temperature against the teacher's
    log-probabilities), carried to dLoss/dzs [..., V]."""
    zs = zs.detach().cpu().double()
    s = zs.gather(-1, ids.cpu()) / temperature
    slack = tvd_slack(s, lps, row_weight, dtype) / temperature
    return torch.zeros_like(zs).scatter_add_(-1, ids.cpu(), slack)


def linear_slacks(dz, xs, ws, bias=None):
    """A bound on dLoss/dz [..., v] carried to (dxs, dws[, dbias]) of z = x w[:v]^T + b[:v]: products with |w|, |x|."""
    v = dz.shape[-1]
    dz = dz.reshape(-1, v)
    dxs = (dz @ ws[:v].cpu().double().abs()).reshape(xs.shape)
    dws = torch.zeros(ws.shape, dtype=torch.float64)
    dws[:v] = dz.T @ xs.cpu().double().abs().reshape(-1, xs.shape[-1])
    if bias is None:
        return [dxs, dws]
    dbias = torch.zeros(bias.shape, dtype=torch.float64)
    dbias[:v] = dz.sum(0)
    return [dxs, dws, dbias]


def fused_linear_tvd_slacks(xs, xt, ws, wt, upstream, *, temperature=1.0, reduction="mean", labels=None,
                            ignore_index=-100, vocab_size=None, bias_s=None, bias_t=None, logit_scale_s=1.0,
                            logit_scale_t=1.0, softcap_s=None, softcap_t=None, **_):
    """tvd_slack carried to (dxs, dws[, dbias_s]) through the student's logits z = softcap(a (x w^T + b)):
    |dz| <= |a| |ds| / temperature (the soft-cap's derivative is at most 1)."""
    v = vocab_size or ws.shape[0]

    def logits(x, w, b, a, cap):
        return reference.model_logits(x.cpu().double(), w[:v].cpu().double(), logit_scale=a, softcap=cap,
                                      bias=None if b is None else b[:v].cpu().double())

    s = logits(xs, ws, bias_s, logit_scale_s, softcap_s) / temperature
    t = logits(xt, wt, bias_t, logit_scale_t, softcap_t) / temperature
    weights = row_weights(upstream, s.shape[:-1], labels, reduction, ignore_index)
    dz = tvd_slack(s, t, weights, xs.dtype) * abs(logit_scale_s) / temperature
    return linear_slacks(dz, xs, ws, bias_s)


def make_biases(ws, wt, *, scale=1.0, seed=1):
    """lm_head biases [V_rows] for ws and wt, of std `scale` (in logit units), in the weights' dtype."""
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(w.shape[0], generator=g, dtype=torch.float64) * scale).to(w.dtype).to(w.device)
                 for w in (ws, wt))


def reference_values_and_grads(xs, xt, ws, wt, upstream, *, dtype, beta, bias_s=None, bias_t=None, **options):
    """Reference loss and (dxs, dws[, dbias_s]) by autograd, evaluated in `dtype`."""
    options.update(reference_options(beta))
    xs_ = xs.detach().to(dtype).requires_grad_()
    ws_ = ws.detach().to(dtype).requires_grad_()
    leaves = [xs_, ws_]
    if bias_s is not None:
        bias_s = bias_s.detach().to(dtype).requires_grad_()
        leaves.append(bias_s)
    if bias_t is not None:
        bias_t = bias_t.to(dtype)
    loss = reference.fused_linear(xs_, xt.to(dtype), ws_, wt.to(dtype), dtype=None, bias_s=bias_s, bias_t=bias_t,
                                  **options)
    return (loss.detach(), *torch.autograd.grad(loss, leaves, upstream.to(dtype)))


def nitrobrew_values_and_grads(xs, xt, ws, wt, upstream, *, beta, bias_s=None, **options):
    xs_ = xs.detach().clone().requires_grad_()
    ws_ = ws.detach().clone().requires_grad_()
    leaves = [xs_, ws_]
    if bias_s is not None:
        bias_s = bias_s.detach().clone().requires_grad_()
        leaves.append(bias_s)
    loss = nitrobrew_loss(xs_, xt, ws_, wt, beta=beta, bias_s=bias_s, **options)
    return (loss.detach(), *torch.autograd.grad(loss, leaves, upstream.to(loss.dtype)))


def bias_gradient_k(x, k):
    """The tolerance factor of an lm_head bias's gradient: on CUDA with 16-bit inputs it is a column
    sum of the 16-bit dLoss/dz chunk (as a 16-bit nn.Linear's bias gradient is a sum of its 16-bit
    grad_output), with no hidden state to spread the entries' rounding, which piles up where the
    column's terms cancel: 4.3x the output rounding in the draws seen (topk_kl normalize="full",
    bfloat16, randomized seed 3 on the H100)."""
    return max(k, 8.0) if x.device.type == "cuda" and x.element_size() == 2 else k


def check_against_reference(xs, xt, ws, wt, *, beta, upstream=None, k=2.0, rel_floor=1e-6, loss_floor=0.0, chunk_V=None,
                            grad_in_forward=None, grad_chunk_mib=None, **options):
    """Values and gradients of nitrobrew vs the float64 oracle, with the same-precision
    reference (float32 for float32/bf16/fp16 inputs, which nitrobrew accumulates in fp32).
    grad_in_forward, grad_chunk_mib: which path nitrobrew takes (None: the automatic choice)."""
    reduction = options.get("reduction", "mean")
    if upstream is None:
        shape = xs.shape[:-1] if reduction == "none" else ()
        upstream = torch.randn(shape, dtype=torch.float64, device=xs.device)
    ours = nitrobrew_values_and_grads(xs, xt, ws, wt, upstream, beta=beta, chunk_V=chunk_V,
                                      grad_in_forward=grad_in_forward, grad_chunk_mib=grad_chunk_mib, **options)
    oracle = reference_values_and_grads(xs, xt, ws, wt, upstream, dtype=torch.float64, beta=beta, **options)
    same_dtype = torch.float64 if xs.dtype == torch.float64 else torch.float32
    if xs.device.type == "cuda" and xs.dtype in (torch.bfloat16, torch.float16):
        # The CUDA backward rounds dLoss/dz to the inputs' dtype before its tensor-core GEMMs
        # (as every tensor-core backward does), on top of rounding the gradients themselves;
        # where the terms of a gradient cancel, that costs several times the output rounding: up to
        # 4.06x in the randomized draws (seed 21 on the H100: dws, reverse KL at T = 0.36 with the CE
        # add-on, bfloat16).
        k = max(k, 5.0)
    same = reference_values_and_grads(xs, xt, ws, wt, upstream, dtype=same_dtype, beta=beta, **options)
    k_bias = bias_gradient_k(xs, k)
    assert ours[0].dtype == same_dtype, f"loss dtype {ours[0].dtype}, expected {same_dtype}"
    assert ours[1].dtype == xs.dtype and ours[2].dtype == ws.dtype, "gradients must have the inputs' dtype"
    assert len(ours) == len(oracle) == len(same)
    slacks = [None] * len(ours)
    if divergence_of(beta) == "tvd":
        slacks[1:] = fused_linear_tvd_slacks(xs, xt, ws, wt, upstream, **options)
    for name, a, o, s, slack in zip(("loss", "dxs", "dws", "dbias_s"), ours, oracle, same, slacks):
        assert_close_to_oracle(a, o, s, k=k_bias if name == "dbias_s" else k, rel_floor=rel_floor,
                               abs_floor=loss_floor if name == "loss" else 0.0, slack=slack, what=name)
    return ours, oracle


# ---------------------------------------------------------------- attention KL -----

KINDS = ["forward", "reverse"]
GQA = {"none": (1, 1), "student": (2, 1), "teacher": (1, 4), "both": (2, 4)}  # query heads per key head (s, t)


def make_attention(b=2, n_q=37, n_k=45, heads=4, gqa="none", d_s=24, d_t=40, *, dtype=torch.float32, scale=1.0,
                   masked=False, seed=0, device="cpu"):
    """Student and teacher queries and keys [B, N, H, D] (scores ~ N(0, scale^2) at the default
    scales) and, if masked, a [B, N_k] key mask with ~30% of the keys hidden."""
    g = torch.Generator().manual_seed(seed)
    h_ks, h_kt = (heads // group for group in GQA[gqa])
    q_s = torch.randn(b, n_q, heads, d_s, generator=g, dtype=torch.float64) * scale
    k_s = torch.randn(b, n_k, h_ks, d_s, generator=g, dtype=torch.float64)
    q_t = torch.randn(b, n_q, heads, d_t, generator=g, dtype=torch.float64) * scale
    k_t = torch.randn(b, n_k, h_kt, d_t, generator=g, dtype=torch.float64)
    mask = torch.rand(b, n_k, generator=g) > 0.3 if masked else None
    mask = mask.to(device) if masked else None
    return (*(t.to(dtype=dtype, device=device) for t in (q_s, k_s, q_t, k_t)), mask)


def attention_values_and_grads(fn, q_s, k_s, q_t, k_t, upstream, **options):
    q_s = q_s.detach().clone().requires_grad_()
    k_s = k_s.detach().clone().requires_grad_()
    loss = fn(q_s, k_s, q_t, k_t, **options)
    dq, dk = torch.autograd.grad(loss, (q_s, k_s), upstream.to(loss.dtype))
    return loss.detach(), dq, dk


def check_attention(q_s, k_s, q_t, k_t, *, k=2.0, rel_floor=None, loss_floor=0.0, **options):
    """nitrobrew.attention_kl vs the float64 oracle, within k x the error of the reference evaluated
    in the precision the kernel accumulates in (float32 for 16- and 32-bit inputs)."""
    reduction = options.get("reduction", "mean")
    shape = (q_s.shape[0], q_s.shape[2], q_s.shape[1]) if reduction == "none" else ()
    upstream = torch.randn(shape, dtype=torch.float64).to(q_s.device)
    ours = attention_values_and_grads(nitrobrew.attention_kl, q_s, k_s, q_t, k_t, upstream, **options)
    reference_options = {key: value for key, value in options.items() if key != "deterministic"}
    oracle = attention_values_and_grads(reference.attention_kl, q_s, k_s, q_t, k_t, upstream, dtype=torch.float64,
                                        **reference_options)
    same_dtype = torch.float64 if q_s.dtype == torch.float64 else torch.float32
    same = attention_values_and_grads(reference.attention_kl, q_s, k_s, q_t, k_t, upstream, dtype=same_dtype,
                                      **reference_options)
    assert ours[0].dtype == same_dtype and ours[1].dtype == q_s.dtype and ours[2].dtype == k_s.dtype
    # float64 inputs are accumulated in float64: the same-precision reference is the oracle
    # itself, so hold them to a float64-sized floor.
    if rel_floor is None:
        rel_floor = 1e-12 if q_s.dtype == torch.float64 else 1e-6
    for name, a, o, s in zip(("loss", "dq_s", "dk_s"), ours, oracle, same):
        # A 16-bit gradient may differ from the rounded float32 one by a rounding step: any error
        # before the final rounding (the CUDA kernels round dS to the input dtype for the tensor
        # cores, as FlashAttention does) can tip an entry to its neighbour, while the float32
        # result's own rounding error happens to be small on some draws.
        floor = max(rel_floor, torch.finfo(a.dtype).eps) if a.element_size() == 2 else rel_floor
        assert_close_to_oracle(a, o, s, k=k, rel_floor=floor, abs_floor=loss_floor if name == "loss" else 0.0,
                               what=name)
    return ours, oracle


def force_sm80(monkeypatch, forced: bool) -> None:
    """NITROBREW_FORCE_SM80=1 (the mma.sync kernels everywhere) or unset, for this test."""
    if forced:
        monkeypatch.setenv("NITROBREW_FORCE_SM80", "1")
    else:
        monkeypatch.delenv("NITROBREW_FORCE_SM80", raising=False)


def assert_compiled_gradients_match(step, q_s, k_s, **compile_options) -> None:
    """step(q_s, k_s) -> loss under torch.compile(fullgraph=True) gives eager's gradients."""
    compiled = torch.compile(step, fullgraph=True, **compile_options)
    a, b = q_s.clone().requires_grad_(), k_s.clone().requires_grad_()
    compiled(a, b).backward()
    a_ref, b_ref = q_s.clone().requires_grad_(), k_s.clone().requires_grad_()
    step(a_ref, b_ref).backward()
    torch.testing.assert_close(a.grad, a_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)
