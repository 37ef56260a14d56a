"""What each rank runs in the vocabulary-parallel tests: every case's loss over its shard of the
vocabulary against the single-process loss of the whole vocabulary (values and gradients), and the
float64 reference (nitrobrew.reference), in one process group per world size."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import nitrobrew
from nitrobrew import reference

# Uneven shards of a vocabulary of V = 37 rows (ws / wt padded to ROWS with vocab_size < ROWS).
V = 37
SHARDS = {1: [V], 2: [20, 17], 3: [12, 1, 24], 4: [10, 13, 5, 9]}
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd")
LOSSES = {name: getattr(nitrobrew, name) for name in DIVERGENCES}
LOGIT_LOSSES = {name: getattr(nitrobrew.logits, name) for name in DIVERGENCES}


def _reference_options(divergence: str, options: dict) -> dict:
    """The reference's options for a case: its weight (beta, or alpha) as `beta`, and the divergence's name."""
    weight = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(divergence, options.get("beta", options.get("alpha", 0.0)))
    return dict({k: v for k, v in options.items() if k not in ("beta", "alpha")}, beta=weight, divergence=divergence)

# (divergence, options) of the fused-linear cases: every divergence, with and without each option.
FUSED_LINEAR_CASES = [
    ("forward_kl", {}),
    ("reverse_kl", {}),
    ("jsd", {"beta": 0.3}),
    ("jsd", {"beta": 0.0}),
    ("jsd", {"beta": 1.0}),
    ("forward_kl", {"labels": True, "reduction": "none"}),
    ("reverse_kl", {"labels": True, "ce_weight": 0.5, "temperature": 2.0}),
    ("jsd", {"beta": 0.7, "labels": True, "ce_weight": 1.0, "reduction": "sum"}),
    ("forward_kl", {"softcap_s": 3.0, "softcap_t": 4.0, "temperature": 0.5}),
    ("jsd", {"beta": 0.4, "bias": True, "logit_scale_s": 0.8, "logit_scale_t": 1.3}),
    ("reverse_kl", {"bias": True, "softcap_s": 5.0, "labels": True, "ce_weight": 0.2}),
    # padded vocabularies: the last 8 rows are padding, so vocab_size falls inside a shard, and with
    # world 4 the last shard lies wholly past it
    ("forward_kl", {"vocab_size": V - 8, "labels": True, "ce_weight": 0.3}),
    ("jsd", {"beta": 0.5, "vocab_size": V - 9, "bias": True}),
    ("reverse_kl", {"vocab_size": V - 12, "temperature": 0.7}),
    # the second-pass divergences beyond JSD
    ("skew_forward_kl", {"alpha": 0.2, "labels": True, "ce_weight": 0.5}),
    ("skew_reverse_kl", {"alpha": 0.6, "bias": True, "vocab_size": V - 9, "reduction": "sum"}),
    ("tvd", {"softcap_s": 3.0, "temperature": 1.5, "labels": True, "reduction": "none"}),
]


def _inputs(dtype, n=23, d_s=12, d_t=20, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, d_s, generator=g, dtype=torch.float64)
    xt = torch.randn(n, d_t, generator=g, dtype=torch.float64)
    ws = torch.randn(V, d_s, generator=g, dtype=torch.float64) * 3 / d_s**0.5
    wt = torch.randn(V, d_t, generator=g, dtype=torch.float64) * 3 / d_t**0.5
    bias_s, bias_t = torch.randn(V, generator=g, dtype=torch.float64), torch.randn(V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V - 12, (n,), generator=g)
    labels[::4] = -100
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    return [(t.to(dtype) if t.is_floating_point() else t).to(device)
            for t in (xs, xt, ws, wt, bias_s, bias_t, labels, upstream)]


def _shard_rows(rank: int, world: int) -> slice:
    sizes = SHARDS[world]
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _run(loss_fn, divergence, xs, xt, ws, wt, bias_s, bias_t, labels, upstream, options, **extra):
    """Loss and gradients (xs, ws[, bias_s]) of one call, and with return_entropy=True the entropy third."""
    leaves = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
    if bias_s is not None:
        leaves.append(bias_s.clone().requires_grad_())
    out = loss_fn[divergence](leaves[0], xt, leaves[1], wt, bias_s=leaves[2] if bias_s is not None else None,
                              bias_t=bias_t, labels=labels, **options, **extra)
    loss, entropy = out if extra.get("return_entropy") else (out, None)
    grads = torch.autograd.grad(loss, leaves, upstream if loss.dim() else upstream.sum())
    return (loss.detach(), grads) if entropy is None else (loss.detach(), grads, entropy)


def _close(actual, expected, rtol, what):
    err = (actual.double() - expected.double()).abs().max().item() if expected.numel() else 0.0
    bound = rtol * max(expected.double().abs().max().item() if expected.numel() else 0.0, 1e-30)
    assert torch.isfinite(actual).all() and err <= bound, f"{what}: error {err:.3e} > {bound:.3e}"


def _tolerances(dtype):
    """(loss, gradients) relative to the largest entry, of a shard's result against the whole's: float64
    exact to rounding; float32 and 16-bit losses from float32 row states; 16-bit gradients rounded to
    their dtype on each shard before the hidden states' sum over shards (two roundings of 2^-8 each)."""
    if dtype == torch.float64:
        return 1e-12, 1e-12
    return 2e-5, (2e-5 if dtype == torch.float32 else 2 ** -6)


def _device():
    """The device of this rank's tensors: its GPU where CUDA is in use (ranks share GPU 0 over gloo)."""
    return "cuda" if torch.cuda.is_available() and os.environ.get("NITROBREW_TEST_DEVICE") == "cuda" else "cpu"


def _ops_run(fn):
    """fn's result and the nitrobrew ops it ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("nitrobrew::")}


def fused_linear(rank: int, world: int, dtype_name: str, grad_in_forward: bool | None = False) -> None:
    """Every case on the recompute path (grad_in_forward False), or on the training path (True) where
    the loss is a scalar (the rest take the recompute path alike), there in chunks of 8 tokens and steps
    of 3 (so that every rank runs several steps' collectives and several chunks' dws sums)."""
    if grad_in_forward is not False:
        from nitrobrew import _forward_grads

        _forward_grads.chunk_plan = lambda *args: _forward_grads.Chunks(grad_rows=8, product_rows=3)
    dtype, device = getattr(torch, dtype_name), _device()
    rtol, gtol = _tolerances(dtype)
    rows = _shard_rows(rank, world)
    for divergence, case in FUSED_LINEAR_CASES:
        options = dict(case)
        training = grad_in_forward is not False and options.get("reduction") != "none"
        path = {"grad_in_forward": grad_in_forward} if training else {"grad_in_forward": False}
        xs, xt, ws, wt, bias_s, bias_t, labels, upstream = _inputs(dtype, device=device)
        if not options.pop("bias", False):
            bias_s = bias_t = None
        if not options.pop("labels", False):
            labels = None
        if options.get("reduction") != "none":
            upstream = upstream[0]
        what = f"rank {rank}/{world} {dtype_name} {divergence} {options} bias={bias_s is not None}"
        try:
            # The student's entropy asked for in every other case: the loss and gradients are the same either way.
            entropy = {"return_entropy": True} if FUSED_LINEAR_CASES.index((divergence, case)) % 2 else {}
            whole = _run(LOSSES, divergence, xs, xt, ws, wt, bias_s, bias_t, labels, upstream, options, **entropy)
            shard, ran = _ops_run(lambda: _run(
                LOSSES, divergence, xs, xt, ws[rows], wt[rows], None if bias_s is None else bias_s[rows],
                None if bias_t is None else bias_t[rows], labels, upstream, options, process_group=dist.group.WORLD,
                **path, **entropy))
            # the training path's backward only scales what its forward formed
            assert ("nitrobrew::scaled" in ran) == training, f"{what}: the ops that ran: {sorted(ran)}"
            _close(shard[0], whole[0], rtol, f"{what}: loss")
            if entropy:  # the whole vocabulary's (itself tested against float64 in tests/fused_linear)
                assert shard[2].shape == xs.shape[:1] and not shard[2].requires_grad, what
                _close(shard[2], whole[2], rtol, f"{what}: entropy")
            _close(shard[1][0], whole[1][0], gtol, f"{what}: xs.grad")
            _close(shard[1][1], whole[1][1][rows], gtol, f"{what}: ws.grad")
            if bias_s is not None:
                _close(shard[1][2], whole[1][2][rows], gtol, f"{what}: bias_s.grad")
            if dtype == torch.float64:  # and the materializing reference, by autograd
                ref_options = _reference_options(divergence, options)
                leaves = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
                if bias_s is not None:
                    leaves.append(bias_s.clone().requires_grad_())
                ref = reference.fused_linear(leaves[0], xt, leaves[1], wt, labels=labels,
                                             bias_s=leaves[2] if bias_s is not None else None, bias_t=bias_t,
                                             **ref_options)
                ref_grads = torch.autograd.grad(ref, leaves, upstream)
                _close(shard[0], ref.detach(), 1e-10, f"{what}: loss vs reference")
                if entropy:
                    ent_options = {k: v for k, v in options.items() if k in ("temperature", "softcap_s", "vocab_size",
                                                                             "logit_scale_s")}
                    ref_entropy = reference.student_entropy(xs, ws, labels=labels, bias_s=bias_s, **ent_options)
                    _close(shard[2], ref_entropy, 1e-10, f"{what}: entropy vs reference")
                _close(shard[1][0], ref_grads[0], 1e-10, f"{what}: xs.grad vs reference")
                _close(shard[1][1], ref_grads[1][rows], 1e-10, f"{what}: ws.grad vs reference")
                if bias_s is not None:
                    _close(shard[1][2], ref_grads[2][rows], 1e-10, f"{what}: bias_s.grad vs reference")
            if dtype in (torch.bfloat16, torch.float16):  # the CUDA tests' tolerance rule against float64
                _check_16bit_against_reference(shard, divergence, xs, xt, ws, wt, bias_s, bias_t, labels, upstream,
                                               options, rows, what)
        except Exception as error:  # at once: a rank that went on would leave the others in a collective
            raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error


def _check_16bit_against_reference(shard, divergence, xs, xt, ws, wt, bias_s, bias_t, labels, upstream, options,
                                   rows, what):
    """A shard's 16-bit loss and gradients within the rule of the single-device CUDA tests
    (tests/helpers.py): k times the error of float32 PyTorch against float64, the shards' ws.grad and
    bias_s.grad put together first. The rule bounds a whole tensor's largest error by the baseline's
    largest; on a shard of one row it would compare two single roundings, and one that happens to land
    exactly fails it."""
    from helpers import assert_close_to_oracle, reference_values_and_grads

    def whole(grad):  # every shard's rows, summed into zeros: exact, and a collective every rank joins
        rows_of_whole = torch.zeros((V,) + tuple(grad.shape[1:]), dtype=torch.float32, device=grad.device)
        rows_of_whole[rows] = grad.float()
        dist.all_reduce(rows_of_whole)
        return rows_of_whole.to(grad.dtype)

    ref_options = _reference_options(divergence, options)
    name = ref_options.pop("divergence")  # reference_values_and_grads takes the tests' (name, weight) pairs
    ref_options.update(beta=ref_options["beta"] if name in ("forward_kl", "reverse_kl", "jsd") else
                       (name, ref_options["beta"]), labels=labels)
    oracle = reference_values_and_grads(xs, xt, ws, wt, upstream, dtype=torch.float64, bias_s=bias_s, bias_t=bias_t,
                                        **ref_options)
    same = reference_values_and_grads(xs, xt, ws, wt, upstream, dtype=torch.float32, bias_s=bias_s, bias_t=bias_t,
                                      **ref_options)
    for i, name in enumerate(("loss", "dxs", "dws", "dbias_s")[: len(oracle)]):
        actual = shard[0] if i == 0 else shard[1][i - 1]
        if name in ("dws", "dbias_s"):
            actual = whole(actual)
        assert_close_to_oracle(actual, oracle[i], same[i], k=8.0 if name == "dbias_s" else 5.0,
                               what=f"{what}: {name} vs reference")


def logits(rank: int, world: int, dtype_name: str) -> None:
    dtype, device = getattr(torch, dtype_name), _device()
    rtol, gtol = _tolerances(dtype)
    cols = _shard_rows(rank, world)
    for divergence, options in [("forward_kl", {}), ("reverse_kl", {"temperature": 0.5}),
                                ("jsd", {"beta": 0.3, "labels": True, "reduction": "none"}),
                                ("jsd", {"beta": 0.8, "masked_vocab": True}), ("forward_kl", {"masked_vocab": True}),
                                ("skew_forward_kl", {"alpha": 0.3, "masked_vocab": True}),
                                ("skew_reverse_kl", {"alpha": 0.1, "labels": True, "reduction": "none"}),
                                ("tvd", {"masked_vocab": True, "temperature": 2.0})]:
        options = dict(options)
        g = torch.Generator().manual_seed(1)
        zs = (torch.randn(19, V, generator=g, dtype=torch.float64) * 3).to(device=device, dtype=dtype)
        zt = (torch.randn(19, V, generator=g, dtype=torch.float64) * 3).to(device=device, dtype=dtype)
        if options.pop("masked_vocab", False):  # -inf entries: a whole shard's worth, in every row of both
            zs[:, 5:15] = zt[:, 5:15] = float("-inf")  # models (a masked vocabulary) and in some of the teacher's
            zt[:4, 20:] = float("-inf")
        labels = torch.randint(0, V, (19,), generator=g).to(device)
        labels[::3] = -100
        labels = labels if options.pop("labels", False) else None
        upstream = torch.randn(19, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        if options.get("reduction") != "none":
            upstream = upstream[0]
        what = f"rank {rank}/{world} {dtype_name} logits {divergence} {options}"
        try:
            results = []
            for z_s, z_t, extra in ((zs, zt, {}), (zs[:, cols], zt[:, cols], {"process_group": dist.group.WORLD})):
                leaf = z_s.clone().requires_grad_()
                loss = LOGIT_LOSSES[divergence](leaf, z_t, labels=labels, **options, **extra)
                results.append((loss.detach(), torch.autograd.grad(loss, leaf, upstream)[0]))
            (whole, d_whole), (shard, d_shard) = results
            _close(shard, whole, rtol, f"{what}: loss")
            _close(d_shard, d_whole[:, cols], gtol, f"{what}: zs.grad")
            if dtype == torch.float64:  # and the materializing reference, by autograd
                leaf = zs.clone().requires_grad_()
                ref = reference.logits(leaf, zt, labels=labels, **_reference_options(divergence, options))
                _close(shard, ref.detach(), 1e-10, f"{what}: loss vs reference")
                _close(d_shard, torch.autograd.grad(ref, leaf, upstream)[0][:, cols], 1e-10,
                       f"{what}: zs.grad vs reference")
        except Exception as error:  # at once: a rank that went on would leave the others in a collective
            raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error


# normalize="topk" takes every divergence (the teacher below has -inf entries: reverse KL would be +inf).
TOPK_CASES = [
    {"normalize": "full"},
    {"normalize": "topk"},
    {"normalize": "full", "labels": True, "temperature": 0.5, "reduction": "none"},
    {"normalize": "topk", "labels": True, "bias": True, "reduction": "sum", "divergence": "jsd", "beta": 0.3},
    {"normalize": "full", "bias": True, "logit_scale_s": 1.7},
    {"normalize": "topk", "logit_scale_s": 0.6, "temperature": 2.0, "divergence": "tvd"},
    {"normalize": "topk", "labels": True, "reduction": "none", "divergence": "skew_reverse_kl", "alpha": 0.4},
    {"normalize": "full", "labels": True, "bias": True, "reduction": "sum", "temperature": 1.5},
]


def _teacher(n, k, seed):
    """Top-K ids spread over every shard, some repeated, and log-probabilities with -inf entries (and
    in one row all -inf)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n)])
    ids[1, 1] = ids[1, 0]  # a repeated id
    logprobs = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64), -1).gather(1, ids)
    logprobs[2, 3:] = float("-inf")
    return ids, logprobs


def topk_linear(rank: int, world: int, dtype_name: str, grad_in_forward: bool = False) -> None:
    """Every case on the recompute path, or (grad_in_forward) on the training path where it runs (normalize
    "full", a scalar loss; checked by the ops it ran), there in chunks of 8 tokens and steps of 3."""
    if grad_in_forward:
        from nitrobrew import _forward_grads

        _forward_grads.chunk_plan = lambda *args: _forward_grads.Chunks(grad_rows=8, product_rows=3)
    dtype, device = getattr(torch, dtype_name), _device()
    rtol, gtol = _tolerances(dtype)
    rows = _shard_rows(rank, world)
    for options in TOPK_CASES:
        options = dict(options)
        training = grad_in_forward and options["normalize"] == "full" and options.get("reduction") != "none"
        xs, _, ws, _, bias_s, _, labels, upstream = _inputs(dtype, seed=3, device=device)
        ids, logprobs = (t.to(device) for t in _teacher(xs.shape[0], 6, seed=4))
        logprobs = logprobs.to(dtype)
        bias_s = bias_s if options.pop("bias", False) else None
        labels = labels if options.pop("labels", False) else None
        if options.get("reduction") != "none":
            upstream = upstream[0]
        what = f"rank {rank}/{world} {dtype_name} topk {options} bias={bias_s is not None}"
        try:
            results = []
            for w, b, extra in ((ws, bias_s, {"grad_in_forward": False}),
                                (ws[rows], None if bias_s is None else bias_s[rows],
                                 {"process_group": dist.group.WORLD, "grad_in_forward": training})):
                leaves = [xs.clone().requires_grad_(), w.clone().requires_grad_()]
                if b is not None:
                    leaves.append(b.clone().requires_grad_())
                loss, ran = _ops_run(lambda: nitrobrew.topk_kl(leaves[0], leaves[1], ids, logprobs, labels=labels,
                                                               bias_s=leaves[2] if b is not None else None,
                                                               **options, **extra))
                results.append((loss.detach(), torch.autograd.grad(loss, leaves, upstream)))
            assert ("nitrobrew::products" in ran and "nitrobrew::topk_linear_fwd" not in ran) == training, ran
            (whole, d_whole), (shard, d_shard) = results
            _close(shard, whole, rtol, f"{what}: loss")
            _close(d_shard[0], d_whole[0], gtol, f"{what}: xs.grad")
            _close(d_shard[1], d_whole[1][rows], gtol, f"{what}: ws.grad")
            if bias_s is not None:
                _close(d_shard[2], d_whole[2][rows], gtol, f"{what}: bias_s.grad")
            if dtype == torch.float64:
                leaves = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
                ref = reference.topk_linear(leaves[0], leaves[1], ids, logprobs, bias_s=bias_s, labels=labels,
                                            **_reference_options(options.get("divergence", "forward_kl"), options))
                ref_grads = torch.autograd.grad(ref, leaves, upstream)
                _close(shard, ref.detach(), 1e-10, f"{what}: loss vs reference")
                _close(d_shard[0], ref_grads[0], 1e-10, f"{what}: xs.grad vs reference")
                _close(d_shard[1], ref_grads[1][rows], 1e-10, f"{what}: ws.grad vs reference")
        except Exception as error:  # at once: a rank that went on would leave the others in a collective
            raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error


def topk_logits(rank: int, world: int, dtype_name: str) -> None:
    """nitrobrew.logits.topk_kl over the ranks' columns of the student's logits."""
    dtype, device = getattr(torch, dtype_name), _device()
    rtol, gtol = _tolerances(dtype)
    cols = _shard_rows(rank, world)
    for options in TOPK_CASES:
        options = {k: v for k, v in options.items() if k not in ("bias", "logit_scale_s")}
        g = torch.Generator().manual_seed(5)
        zs = (torch.randn(21, V, generator=g, dtype=torch.float64) * 3).to(device=device, dtype=dtype)
        ids, logprobs = (t.to(device) for t in _teacher(21, 6, seed=6))
        logprobs = logprobs.to(dtype)
        labels = torch.randint(0, V, (21,), generator=g).to(device)
        labels[::4] = -100
        labels = labels if options.pop("labels", False) else None
        upstream = torch.randn(21, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        if options.get("reduction") != "none":
            upstream = upstream[0]
        what = f"rank {rank}/{world} {dtype_name} logits.topk_kl {options}"
        try:
            results = []
            for z, extra in ((zs, {}), (zs[:, cols], {"process_group": dist.group.WORLD})):
                leaf = z.clone().requires_grad_()
                loss = nitrobrew.logits.topk_kl(leaf, ids, logprobs, labels=labels, **options, **extra)
                results.append((loss.detach(), torch.autograd.grad(loss, leaf, upstream)[0]))
            (whole, d_whole), (shard, d_shard) = results
            _close(shard, whole, rtol, f"{what}: loss")
            _close(d_shard, d_whole[:, cols], gtol, f"{what}: zs.grad")
            if dtype == torch.float64:  # and the materializing reference, by autograd
                leaf = zs.clone().requires_grad_()
                ref = reference.topk_logits(leaf, ids, logprobs, labels=labels,
                                            **_reference_options(options.get("divergence", "forward_kl"), options))
                _close(shard, ref.detach(), 1e-10, f"{what}: loss vs reference")
                _close(d_shard, torch.autograd.grad(ref, leaf, upstream)[0][:, cols], 1e-10,
                       f"{what}: zs.grad vs reference")
        except Exception as error:  # at once: a rank that went on would leave the others in a collective
            raise AssertionError(f"{what}: {type(error).__name__}: {error}") from error


def errors(rank: int, world: int) -> None:
    """Bad input to the sharded losses: a clear error naming the argument, on every rank alike."""
    xs, xt, ws, wt, _, _, labels, _ = _inputs(torch.float64)
    rows = _shard_rows(rank, world)
    group = dist.group.WORLD
    cases = {
        "ws and wt of different rows": (ValueError, "same vocabulary rows",
                                        lambda: nitrobrew.forward_kl(xs, xt, ws[rows], wt[rows][:-1] if rank == 0
                                                                     else wt[rows], process_group=group)),
        "vocab_size past the shards": (ValueError, "vocab_size must be at most",
                                       lambda: nitrobrew.forward_kl(xs, xt, ws[rows], wt[rows], vocab_size=V + 1,
                                                                    process_group=group)),
        "a label past vocab_size": (IndexError, "labels",
                                    lambda: nitrobrew.forward_kl(xs, xt, ws[rows], wt[rows], labels=labels + V,
                                                                 ce_weight=1.0, process_group=group)),
        "a label past vocab_size, training path": (IndexError, "labels",
                                                   lambda: nitrobrew.forward_kl(
                                                       xs.clone().requires_grad_(), xt, ws[rows], wt[rows],
                                                       labels=labels + V, ce_weight=1.0, process_group=group,
                                                       grad_in_forward=True)),
        # A rank that does not ask would leave the others' entropy that of their own shards.
        "return_entropy on some ranks only": (ValueError, "return_entropy must be the same on every rank",
                                              lambda: nitrobrew.forward_kl(xs, xt, ws[rows], wt[rows],
                                                                           return_entropy=rank == 0,
                                                                           process_group=group)),
        "a process_group that is no group": (TypeError, "process_group must be",
                                             lambda: nitrobrew.forward_kl(xs, xt, ws[rows], wt[rows],
                                                                          process_group="world")),
        "a teacher id past the vocabulary": (IndexError, "teacher_ids",
                                             lambda: nitrobrew.topk_kl(xs, ws[rows], labels[:, None].clamp(min=0) + V,
                                                                       torch.zeros(xs.shape[0], 1, dtype=xs.dtype),
                                                                       process_group=group)),
        "probabilities passed as teacher log-probabilities": (
            ValueError, "teacher_logprobs must be log-probabilities",
            lambda: nitrobrew.topk_kl(xs, ws[rows], labels[:, None].clamp(min=0).repeat(1, 2),
                                      torch.full((xs.shape[0], 2), 0.5, dtype=xs.dtype), process_group=group)),
    }
    for name, (kind, message, fn) in cases.items():
        try:
            fn()
        except kind as error:
            assert message in str(error), f"{name}: {error}"
        else:
            raise AssertionError(f"{name}: no error")


def float64_on_cuda(rank: int, world: int) -> None:
    """float64 inputs on CUDA over shards: a TypeError on every rank before any collective (a rank whose shard
    holds no rows runs no kernel, and would otherwise wait for the ranks whose kernels refused them)."""
    xs, xt, ws, wt, *_ = _inputs(torch.float64, device="cuda")
    rows = _shard_rows(rank, world)
    for path in (False, True):
        try:
            nitrobrew.forward_kl(xs.clone().requires_grad_(), xt, ws[rows], wt[rows], grad_in_forward=path,
                                 process_group=dist.group.WORLD)
        except TypeError as error:
            assert "float64 inputs are supported on the CPU only" in str(error), error
        else:
            raise AssertionError(f"rank {rank} grad_in_forward={path}: float64 on CUDA: no error")


def module(rank: int, world: int) -> None:
    """DistillationLoss(process_group=) is the function's loss."""
    xs, xt, ws, wt, _, _, labels, _ = _inputs(torch.float64)
    rows = _shard_rows(rank, world)
    loss = nitrobrew.DistillationLoss("jsd", beta=0.4, temperature=1.5, process_group=dist.group.WORLD)
    _close(loss(xs, xt, ws[rows], wt[rows], labels),
           nitrobrew.jsd(xs, xt, ws, wt, beta=0.4, temperature=1.5, labels=labels), 1e-12, f"rank {rank}: module")


def compiled(rank: int, world: int) -> None:
    """Under torch.compile the sharded loss runs eagerly inside the compiled function (a graph break)."""
    xs, xt, ws, wt, _, _, labels, _ = _inputs(torch.float64)
    rows = _shard_rows(rank, world)
    x = xs.clone().requires_grad_()
    step = torch.compile(lambda a: 2 * nitrobrew.forward_kl(a, xt, ws[rows], wt[rows], labels=labels,
                                                            process_group=dist.group.WORLD))
    loss = step(x)
    loss.backward()
    x_ref = xs.clone().requires_grad_()
    expected = 2 * nitrobrew.forward_kl(x_ref, xt, ws, wt, labels=labels)
    expected.backward()
    _close(loss.detach(), expected.detach(), 1e-12, f"rank {rank}: compiled loss")
    _close(x.grad, x_ref.grad, 1e-12, f"rank {rank}: compiled xs.grad")


def empty_shard(rank: int, world: int) -> None:
    """A rank whose shard holds no vocabulary row (as DTensor's torch.chunk layout gives when the ranks
    outnumber the rows): it joins every collective and contributes nothing."""
    xs, xt, ws, wt, _, _, labels, _ = _inputs(torch.float64)
    rows = slice(0, V) if rank == 0 else slice(V, V)
    group = dist.group.WORLD
    ids, logprobs = _teacher(xs.shape[0], 6, seed=4)
    zs = (xs @ ws.T).detach()
    for name, whole_fn, shard_fn, leaf in (
        ("forward_kl with CE", lambda w: nitrobrew.forward_kl(xs, xt, w, wt, labels=labels, ce_weight=0.5),
         lambda w: nitrobrew.forward_kl(xs, xt, w, wt[rows], labels=labels, ce_weight=0.5, process_group=group), ws),
        ("jsd", lambda w: nitrobrew.jsd(xs, xt, w, wt, beta=0.3),
         lambda w: nitrobrew.jsd(xs, xt, w, wt[rows], beta=0.3, process_group=group), ws),
        ("topk_kl", lambda w: nitrobrew.topk_kl(xs, w, ids, logprobs),
         lambda w: nitrobrew.topk_kl(xs, w, ids, logprobs, process_group=group), ws),
        ("logits.jsd", lambda z: nitrobrew.logits.jsd(z, zs, beta=0.6),
         lambda z: nitrobrew.logits.jsd(z, zs[:, rows], beta=0.6, process_group=group), zs),
        ("logits.topk_kl", lambda z: nitrobrew.logits.topk_kl(z, ids, logprobs, normalize="topk"),
         lambda z: nitrobrew.logits.topk_kl(z, ids, logprobs, normalize="topk", process_group=group), zs),
    ):
        whole_leaf = leaf.clone().requires_grad_()
        whole = whole_fn(whole_leaf)
        whole.backward()
        shard_leaf = leaf[rows].clone().requires_grad_() if leaf is ws else leaf[:, rows].clone().requires_grad_()
        loss = shard_fn(shard_leaf)
        loss.backward()
        _close(loss.detach(), whole.detach(), 1e-12, f"rank {rank} {name}: loss")
        expected = whole_leaf.grad[rows] if leaf is ws else whole_leaf.grad[:, rows]
        assert shard_leaf.grad.shape == expected.shape, f"rank {rank} {name}: gradient shape"
        if expected.numel():
            _close(shard_leaf.grad, expected, 1e-12, f"rank {rank} {name}: gradient")
