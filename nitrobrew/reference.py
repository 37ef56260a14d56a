"""Reference implementations: the definitions of nitrobrew's losses written as plain
PyTorch that materializes the [tokens x vocab] logits. For tests and benchmarks only;
evaluate them in float64 to get an oracle.

They also define the non-finite rule every op follows (docs/design.md, "Non-finite inputs"):
-inf logits or log-probabilities are probability 0 and add 0 (0 log 0 = 0); NaN, and +inf in a
logit or log-probability, make the row's loss NaN; so does a distribution with no entry above
-inf (a logit row all -inf; normalize="topk" over K log-probabilities all -inf). Masked rows
(label == ignore_index) are not read: loss 0, gradient 0."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _softcap(z: Tensor, cap: float | None) -> Tensor:
    return z if cap is None else cap * torch.tanh(z / cap)


def model_logits(x: Tensor, w: Tensor, *, bias: Tensor | None = None, logit_scale: float = 1.0,
                 softcap: float | None = None) -> Tensor:
    """A model's logits from its final hidden states: softcap(logit_scale * (x @ w.T + bias))."""
    z = x @ w.T
    if bias is not None:
        z = z + bias
    return _softcap(z * logit_scale, softcap)


def _nan_where(undefined: Tensor, loss: Tensor) -> Tensor:
    return torch.where(undefined, torch.full_like(loss, math.nan), loss)


def _unread_masked_rows(z: Tensor, labels: Tensor | None, ignore_index: int) -> Tensor:
    """Masked rows replaced by zeros: the ops never read them, so their content (even NaN) reaches
    neither the loss nor autograd."""
    if labels is None:
        return z
    return torch.where((labels != ignore_index).unsqueeze(-1), z, torch.zeros_like(z))


def _reduce(loss: Tensor, labels: Tensor | None, ignore_index: int, reduction: str) -> Tensor:
    """Zeroes the rows whose label is ignore_index, then reduces: "none", "sum", or "mean" over the rest."""
    mask = torch.ones_like(loss, dtype=torch.bool) if labels is None else labels != ignore_index
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / mask.sum().clamp(min=1)


def _log(weight: float) -> float:
    return -math.inf if weight == 0.0 else math.log(weight)


def _name_of(divergence: str | None, beta: float) -> str:
    """The divergence a call names; None: named by beta (0 forward KL, 1 reverse KL, otherwise JSD(beta))."""
    if divergence is not None:
        return divergence
    return {0.0: "forward_kl", 1.0: "reverse_kl"}.get(beta, "jsd")


def _mixture_weights(divergence: str, weight: float) -> tuple[float, float] | None:
    """(w_p, w_q) of the mixture M = w_p p + w_q q, or None for the plain KLs (JSD at beta 0 / 1, the skew KLs at
    alpha 0) and TVD."""
    if divergence == "jsd" and 0.0 < weight < 1.0:
        return 1.0 - weight, weight
    if divergence == "skew_forward_kl" and weight > 0.0:
        return 1.0 - weight, weight
    if divergence == "skew_reverse_kl" and weight > 0.0:
        return weight, 1.0 - weight
    return None


def _divergence(log_p: Tensor, log_q: Tensor, divergence: str, weight: float, finite_s: Tensor | None = None,
                finite_t: Tensor | None = None) -> Tensor:
    """Per-row divergence between p = exp(log_p) (student) and q = exp(log_q) (teacher), where the entries whose
    finite_s / finite_t are False (log-probability -inf) have probability 0 and add nothing: their
    log-probabilities are replaced where their terms are dropped, so that autograd never meets -inf - -inf."""
    zero = torch.zeros_like(log_p)
    finite_s = torch.ones_like(log_p, dtype=torch.bool) if finite_s is None else finite_s
    finite_t = torch.ones_like(log_q, dtype=torch.bool) if finite_t is None else finite_t
    safe_p, safe_q = torch.where(finite_s, log_p, zero), torch.where(finite_t, log_q, zero)
    if divergence == "tvd":
        p, q = torch.where(finite_s, safe_p.exp(), zero), torch.where(finite_t, safe_q.exp(), zero)
        return 0.5 * (p - q).abs().sum(-1)  # autograd's subgradient of |x| at 0 is 0, as nitrobrew's
    weights = _mixture_weights(divergence, weight)
    if weights is None:  # a plain KL (a student -inf where the teacher is not makes forward KL +inf)
        if divergence == "forward_kl" or divergence in ("jsd", "skew_forward_kl") and weight == 0.0:
            return torch.where(finite_t, safe_q.exp() * (safe_q - log_p), zero).sum(-1)
        return torch.where(finite_s, safe_p.exp() * (safe_p - log_q), zero).sum(-1)
    w_p, w_q = weights
    if w_p == 0.0 or w_q == 0.0:  # a skew KL at alpha = 1: M is the KL's first side itself, KL(x || x) = 0
        return 0.0 * safe_p.sum(-1)
    # log M from the finite sides only: a side that is -inf adds nothing to M (not exp(0), which its
    # zero-replaced log-probability would add). Entries -inf on both sides are dropped below.
    neither = ~(finite_s | finite_t)
    absent = torch.where(neither, zero, torch.full_like(zero, -math.inf))
    term_p = torch.where(finite_s, safe_p + _log(w_p), absent)
    term_q = torch.where(finite_t, safe_q + _log(w_q), absent)
    log_m = torch.where(neither, zero, torch.logaddexp(term_p, term_q))
    kl_q_m = torch.where(finite_t, safe_q.exp() * (safe_q - log_m), zero).sum(-1)
    kl_p_m = torch.where(finite_s, safe_p.exp() * (safe_p - log_m), zero).sum(-1)
    if divergence == "skew_forward_kl":
        return kl_q_m
    if divergence == "skew_reverse_kl":
        return kl_p_m
    return weight * kl_q_m + (1.0 - weight) * kl_p_m


def divergence_from_logits(s: Tensor, t: Tensor, beta: float, divergence: str | None = None) -> Tensor:
    """Per-row divergence between p = softmax(s) (student) and q = softmax(t) (teacher). divergence: "forward_kl",
    "reverse_kl", "jsd" (beta), "skew_forward_kl", "skew_reverse_kl" (beta holds their alpha) or "tvd"; None:
    beta = 0 forward KL(q||p), beta = 1 reverse KL(p||q), otherwise generalized JSD(beta)."""
    log_p = torch.log_softmax(s, dim=-1)
    log_q = torch.log_softmax(t, dim=-1)
    return _divergence(log_p, log_q, _name_of(divergence, beta), beta)


def fused_linear(
    xs: Tensor,
    xt: Tensor,
    ws: Tensor,
    wt: Tensor,
    *,
    beta: float,
    divergence: str | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: Tensor | None = None,
    ignore_index: int = -100,
    ce_weight: float = 0.0,
    softcap_s: float | None = None,
    softcap_t: float | None = None,
    vocab_size: int | None = None,
    bias_s: Tensor | None = None,
    bias_t: Tensor | None = None,
    logit_scale_s: float = 1.0,
    logit_scale_t: float = 1.0,
    dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """What nitrobrew.forward_kl (beta=0), reverse_kl (beta=1) and jsd(beta) compute, or with `divergence` the
    function of that name (beta: the skew KLs' alpha), with the logits materialized in `dtype` (None: the
    inputs' dtype, as naive PyTorch would)."""
    if dtype is not None:
        xs, xt, ws, wt = (t.to(dtype) for t in (xs, xt, ws, wt))
        bias_s, bias_t = (None if b is None else b.to(dtype) for b in (bias_s, bias_t))
    vocab_size = ws.shape[0] if vocab_size is None else vocab_size
    bias_s, bias_t = (None if b is None else b[:vocab_size] for b in (bias_s, bias_t))
    zs = model_logits(xs, ws[:vocab_size], bias=bias_s, logit_scale=logit_scale_s, softcap=softcap_s)  # [..., V]
    zt = model_logits(xt, wt[:vocab_size], bias=bias_t, logit_scale=logit_scale_t, softcap=softcap_t)
    loss = divergence_from_logits(zs / temperature, zt / temperature, beta, divergence)
    mask = torch.ones_like(loss, dtype=torch.bool) if labels is None else labels != ignore_index
    if ce_weight != 0.0:
        safe_labels = torch.where(mask, labels, torch.zeros_like(labels))
        ce = torch.logsumexp(zs, -1) - zs.gather(-1, safe_labels.unsqueeze(-1)).squeeze(-1)
        loss = loss + ce_weight * ce
    loss = torch.where(mask, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / mask.sum().clamp(min=1)


def student_entropy(
    xs: Tensor,
    ws: Tensor,
    *,
    temperature: float = 1.0,
    labels: Tensor | None = None,
    ignore_index: int = -100,
    softcap_s: float | None = None,
    vocab_size: int | None = None,
    bias_s: Tensor | None = None,
    logit_scale_s: float = 1.0,
    dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """What the fused-linear losses return with return_entropy=True: -sum_v p_v log p_v of the student's
    temperature-scaled distribution per row, masked rows 0."""
    if dtype is not None:
        xs, ws = xs.to(dtype), ws.to(dtype)
        bias_s = None if bias_s is None else bias_s.to(dtype)
    vocab_size = ws.shape[0] if vocab_size is None else vocab_size
    bias_s = None if bias_s is None else bias_s[:vocab_size]
    zs = model_logits(xs, ws[:vocab_size], bias=bias_s, logit_scale=logit_scale_s, softcap=softcap_s)
    log_p = torch.log_softmax(zs / temperature, dim=-1)
    # -inf logits have probability 0 and add 0 (0 log 0 = 0), not 0 * -inf.
    entropy = -torch.where(log_p > -math.inf, log_p.exp() * log_p, torch.zeros_like(log_p)).sum(-1)
    mask = torch.ones_like(entropy, dtype=torch.bool) if labels is None else labels != ignore_index
    return torch.where(mask, entropy, torch.zeros_like(entropy))


def logits(
    zs: Tensor,
    zt: Tensor,
    *,
    beta: float,
    divergence: str | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: Tensor | None = None,
    ignore_index: int = -100,
    dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """What nitrobrew.logits.forward_kl (beta=0), reverse_kl (beta=1) and jsd(beta) compute, or with `divergence`
    the function of that name (beta: the skew KLs' alpha). Entries of
    -inf have probability 0 and contribute 0 (0 log 0 = 0), in the value and in autograd; NaN or +inf
    entries, or a side with no entry above -inf, make the row NaN."""
    if dtype is not None:
        zs, zt = zs.to(dtype), zt.to(dtype)
    zs, zt = _unread_masked_rows(zs, labels, ignore_index), _unread_masked_rows(zt, labels, ignore_index)
    # "finite" below means "not -inf": NaN and +inf stay in and turn the row's log_softmax NaN.
    finite_s, finite_t = zs != -math.inf, zt != -math.inf
    undefined = ~(zs > -math.inf).any(-1) | ~(zt > -math.inf).any(-1)
    log_p = torch.log_softmax(zs / temperature, dim=-1)
    log_q = torch.log_softmax(zt / temperature, dim=-1)
    loss = _divergence(log_p, log_q, _name_of(divergence, beta), beta, finite_s, finite_t)
    return _reduce(_nan_where(undefined, loss), labels, ignore_index, reduction)


def topk_logits(
    zs: Tensor,
    teacher_ids: Tensor,
    teacher_logprobs: Tensor,
    *,
    normalize: str = "full",
    divergence: str = "forward_kl",
    beta: float = 0.0,
    temperature: float = 1.0,
    reduction: str = "mean",
    labels: Tensor | None = None,
    ignore_index: int = -100,
    dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """What nitrobrew.logits.topk_kl computes: forward KL sum_k q_k (log q_k - log p_{id_k}), teacher
    log-probabilities of -inf contributing 0; a NaN or +inf one makes the row NaN, and so does
    normalize="topk" over K log-probabilities that are all -inf. With normalize="topk" another divergence
    (beta: its weight, as `logits` takes it) is the logit-level one between the K gathered student logits and
    the teacher's K log-probabilities."""
    if dtype is not None:
        zs, teacher_logprobs = zs.to(dtype), teacher_logprobs.to(dtype)
    if divergence != "forward_kl":
        if normalize != "topk":
            raise ValueError('normalize="full" takes forward_kl only')
        return logits(zs.gather(-1, teacher_ids) / temperature, teacher_logprobs, beta=beta, divergence=divergence,
                      reduction=reduction, labels=labels, ignore_index=ignore_index, dtype=None)
    zs = _unread_masked_rows(zs, labels, ignore_index)
    teacher_logprobs = _unread_masked_rows(teacher_logprobs, labels, ignore_index)
    undefined = (teacher_logprobs.isnan() | (teacher_logprobs == math.inf)).any(-1)
    if normalize == "topk":
        undefined |= ~(teacher_logprobs > -math.inf).any(-1)
    s = zs / temperature
    if normalize == "full":
        log_p = torch.log_softmax(s, dim=-1).gather(-1, teacher_ids)
        log_q = teacher_logprobs
    else:
        log_p = torch.log_softmax(s.gather(-1, teacher_ids), dim=-1)
        log_q = torch.log_softmax(teacher_logprobs, dim=-1)
    kept = teacher_logprobs != -math.inf
    safe_q = torch.where(kept, log_q, torch.zeros_like(log_q))
    loss = torch.where(kept, safe_q.exp() * (safe_q - log_p), torch.zeros_like(log_p)).sum(-1)
    return _reduce(_nan_where(undefined, loss), labels, ignore_index, reduction)


def topk_linear(xs: Tensor, ws: Tensor, teacher_ids: Tensor, teacher_logprobs: Tensor, *,
                bias_s: Tensor | None = None, logit_scale_s: float = 1.0,
                dtype: torch.dtype | None = torch.float64, **options) -> Tensor:
    """What nitrobrew.topk_kl computes: topk_logits of the materialized logits
    logit_scale_s * (xs @ ws.T + bias_s)."""
    if dtype is not None:
        xs, ws = xs.to(dtype), ws.to(dtype)
        bias_s = None if bias_s is None else bias_s.to(dtype)
    zs = model_logits(xs, ws, bias=bias_s, logit_scale=logit_scale_s)
    return topk_logits(zs, teacher_ids, teacher_logprobs.to(xs.dtype), dtype=None, **options)


def topk_logprobs(x: Tensor, w: Tensor, k: int, *, temperature: float = 1.0, bias: Tensor | None = None,
                  logit_scale: float = 1.0, softcap: float | None = None, vocab_size: int | None = None,
                  dtype: torch.dtype | None = torch.float64) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What nitrobrew.topk_logprobs(..., return_stats=True) computes, from the materialized logits:
    (logprobs, ids, logsumexp, entropy), ids sorted by logit with ties to the lower id (a stable sort); rows with a NaN or +inf logit, or none above -inf, NaN with ids 0..k-1."""
    vocab_size = w.shape[0] if vocab_size is None else vocab_size
    bias = None if bias is None else bias.to(w.dtype)  # the op takes the bias in the weight's dtype
    if dtype is not None:
        x, w = x.to(dtype), w.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    w = w[:vocab_size]
    s = model_logits(x, w, bias=None if bias is None else bias[:vocab_size], logit_scale=logit_scale,
                     softcap=softcap) / temperature
    undefined = (s.isnan() | (s == math.inf)).any(-1) | (s == -math.inf).all(-1)
    lse = torch.logsumexp(s, dim=-1)
    logp = s - lse[..., None]
    entropy = -torch.where(s > -math.inf, logp.exp() * logp, torch.zeros_like(logp)).sum(-1)
    # Ordered by the logits (not their rounded log-probabilities), ties to the lower id; -0.0 == +0.0.
    _, ids = torch.sort(torch.where(undefined[..., None], 0.0, s) + 0.0, dim=-1, descending=True, stable=True)
    ids = torch.where(undefined[..., None], torch.arange(k, device=ids.device), ids[..., :k])
    return (_nan_where(undefined[..., None], logp.gather(-1, ids)), ids, _nan_where(undefined, lse),
            _nan_where(undefined, entropy))


def visible_keys(batch: int, n_queries: int, n_keys: int, *, causal: bool, attention_mask: Tensor | None,
                 device=None) -> Tensor:
    """[B, N_q, N_k] bool: which keys each query row sees (bottom-right causal alignment, as
    FlashAttention: query i sees keys j <= i + N_k - N_q; attention_mask True = attended)."""
    visible = torch.ones(batch, n_queries, n_keys, dtype=torch.bool, device=device)
    if causal:
        i = torch.arange(n_queries, device=device)[:, None]
        j = torch.arange(n_keys, device=device)[None, :]
        visible = visible & (j <= i + n_keys - n_queries)
    if attention_mask is not None:
        visible = visible & attention_mask[:, None, :].to(device)
    return visible


def attention_kl(
    q_s: Tensor,
    k_s: Tensor,
    q_t: Tensor,
    k_t: Tensor,
    *,
    kind: str = "forward",
    causal: bool = False,
    scale_s: float | None = None,
    scale_t: float | None = None,
    temperature: float = 1.0,
    reduction: str = "mean",
    attention_mask: Tensor | None = None,
    query_mask: Tensor | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> Tensor:
    """What nitrobrew.attention_kl computes, with the [B, H, N_q, N_k] scores materialized in
    `dtype` (None: the inputs' dtype). Layout [B, N, H, D]; GQA key heads are repeated. Masks are
    nonzero = attended (keys) / counted (query rows)."""
    if dtype is not None:
        q_s, k_s, q_t, k_t = (t.to(dtype) for t in (q_s, k_s, q_t, k_t))
    b, n_q, h, d_s = q_s.shape
    n_k, d_t = k_s.shape[1], q_t.shape[-1]
    scale_s = d_s ** -0.5 if scale_s is None else scale_s
    scale_t = d_t ** -0.5 if scale_t is None else scale_t

    def scores(q, k, scale):
        k = k.repeat_interleave(h // k.shape[2], dim=2)
        return torch.einsum("bqhd,bkhd->bhqk", q, k) * scale / temperature

    if attention_mask is not None:
        attention_mask = attention_mask != 0
    visible = visible_keys(b, n_q, n_k, causal=causal, attention_mask=attention_mask, device=q_s.device)[:, None]
    row_visible = visible.any(-1)  # [B, 1, N_q]
    if query_mask is not None:  # padded query rows: no loss, no gradient, not counted
        row_visible = row_visible & (query_mask != 0).to(q_s.device)[:, None, :]
    neg_inf = torch.tensor(float("-inf"), dtype=q_s.dtype, device=q_s.device)
    s = torch.where(visible, scores(q_s, k_s, scale_s), neg_inf)
    t = torch.where(visible, scores(q_t, k_t, scale_t), neg_inf)
    # Rows that see no key: any finite logits, their loss is zeroed below (no NaN reaches autograd).
    s = torch.where(row_visible[..., None], s, torch.zeros_like(s))
    t = torch.where(row_visible[..., None], t, torch.zeros_like(t))
    log_p, log_q = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    w_log, o_log = (log_q, log_p) if kind == "forward" else (log_p, log_q)
    # Hidden keys have log-probability -inf: zero them before the product (0 log 0 = 0), so
    # that neither the value nor autograd ever meets -inf - -inf.
    w_log, o_log = (torch.where(visible, x, torch.zeros_like(x)) for x in (w_log, o_log))
    terms = torch.where(visible, w_log.exp() * (w_log - o_log), torch.zeros_like(s))
    loss = torch.where(row_visible, terms.sum(-1), torch.zeros_like(terms[..., 0]))  # [B, H, N_q]
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (row_visible.sum() * h).clamp(min=1)
