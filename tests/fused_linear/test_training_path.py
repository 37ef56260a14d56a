"""The training path (gradients formed in the forward, nitrobrew/_forward_grads.py): when it runs, and
how it behaves where a training loop's machinery meets it: a forward with no backward, activation
checkpointing, gradient accumulation, tied embeddings, saved-tensor hooks, the upstream gradient (CUDA
graphs and torch.compile: test_fused_linear_ops.py). Its values and gradients against the float64 reference are tested with the recompute path's
(test_fused_linear_values.py, test_fused_linear_cuda.py)."""

import pytest
import torch
import torch.utils.checkpoint

import nitrobrew
from conftest import CUDA
from helpers import make_biases, make_problem

CHUNK_OP = "nitrobrew::fused_linear_grad_chunk"
FORWARD_OP = "nitrobrew::fused_linear_fwd"


def ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()} & {CHUNK_OP, FORWARD_OP}


def _problem(device, **kw):
    xs, xt, ws, wt, labels = make_problem(n=45, v=700, device=device, masked=True, **kw)
    return xs.requires_grad_(), xt, ws.requires_grad_(), wt, labels


@pytest.mark.parametrize("case,expected", [
    ("training", CHUNK_OP), ("no_grad", FORWARD_OP), ("inference_mode", FORWARD_OP), ("none", FORWARD_OP),
    ("teacher_only", FORWARD_OP), ("forced_off", FORWARD_OP), ("bias_only", CHUNK_OP), ("forced_on", CHUNK_OP),
])
def test_which_path_runs(device, case, expected):
    # The training path when autograd records a graph for xs, ws or bias_s and the loss is a scalar, and
    # it is asked for or the device is one where the automatic choice takes it; the recompute path's
    # forward otherwise.
    xs, xt, ws, wt, labels = _problem(device)
    kw = dict(labels=labels, reduction="none" if case == "none" else "mean")
    if case == "forced_on":
        kw["grad_in_forward"] = True
    elif expected == CHUNK_OP and device not in nitrobrew._forward_grads.AUTOMATIC_DEVICES:
        expected = FORWARD_OP
    if case in ("teacher_only", "bias_only"):
        xs, ws = xs.detach(), ws.detach()
        xt = xt.clone().requires_grad_()
    if case == "bias_only":
        kw["bias_s"] = torch.zeros(700, device=device, requires_grad=True)
    if case == "forced_off":
        kw["grad_in_forward"] = False
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(case, torch.enable_grad)
    with context():
        assert ops_run(lambda: nitrobrew.jsd(xs, xt, ws, wt, beta=0.4, **kw)) == {expected}


def test_dws_accumulates_in_float32_past_four_roundings():
    # Where dws would be accumulated in 16 bits (CUDA, bf16 / fp16 inputs) over more than MAX_ROUNDED_CHUNKS
    # chunks of G, it accumulates in float32 instead; the CPU's G and float32 inputs' are float32 already.
    fg = nitrobrew._forward_grads
    budget = fg.chunk_budget_bytes(None)
    assert fg.chunk_count(8192, 152064, torch.bfloat16, "cuda", budget) == 2
    assert not fg.float32_dws(8192, 152064, torch.bfloat16, "cuda", budget)
    assert fg.chunk_count(65536, 152064, torch.bfloat16, "cuda", budget) > fg.MAX_ROUNDED_CHUNKS
    assert fg.float32_dws(65536, 152064, torch.float16, "cuda", budget)
    assert not fg.float32_dws(65536, 152064, torch.bfloat16, "cpu", budget)
    assert not fg.float32_dws(65536, 152064, torch.float32, "cuda", budget)
    assert not fg.float32_dws(65536, 152064, torch.bfloat16, "cuda", fg.chunk_budget_bytes(16384))


def test_accumulate_grad_op():
    # acc = g^T . x + beta * acc, in acc's float32 (CUDA: cuBLAS with a float32 C; tests/.._cuda below).
    g, x = torch.randn(7, 5, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    acc = torch.full((5, 3), float("nan"), dtype=torch.float64)
    nitrobrew._registration.ops.accumulate_grad(acc, g, x, 0.0)  # beta 0 ignores what acc held
    torch.testing.assert_close(acc, g.T @ x)
    nitrobrew._registration.ops.accumulate_grad(acc, g, x, 1.0)
    torch.testing.assert_close(acc, 2 * g.T @ x)
    with pytest.raises(RuntimeError, match=r"acc must be \[V, D\], g \[N, V\] and x \[N, D\]"):
        nitrobrew._registration.ops.accumulate_grad(acc, g, x[:, :2], 1.0)


@CUDA
def test_accumulate_grad_op_on_cuda():
    for dtype in (torch.bfloat16, torch.float16):
        g = torch.randn(300, 1001, device="cuda").to(dtype)[:, :999]  # G's padded row stride
        x = torch.randn(300, 64, device="cuda").to(dtype)
        acc = torch.full((999, 64), float("nan"), device="cuda")
        ops = nitrobrew._registration.ops
        ops.accumulate_grad(acc, g, x, 0.0)
        ops.accumulate_grad(acc, g, x, 1.0)
        expected = 2 * g.double().T @ x.double()
        torch.testing.assert_close(acc.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dws_past_four_chunks_keeps_the_recompute_paths_accuracy(dtype):
    # 16-bit tokens under a 1 MiB bound: 4000 tokens take 16 chunks of G, so dws accumulates in float32
    # (nitrobrew::accumulate_grad) and is rounded once: its error stays within 1.5x the recompute path's.
    # Rounded to 16 bits per chunk it would be ~2.5x one rounding (tools/profiling/dws_rounding.py).
    fg = nitrobrew._forward_grads
    assert fg.chunk_count(4000, 1001, dtype, "cuda", 1 << 20) >= 16 and fg.float32_dws(4000, 1001, dtype, "cuda", 1 << 20)
    xs, xt, ws, wt, labels = make_problem(n=4000, v=1001, d_s=64, d_t=48, dtype=dtype, device="cuda")
    x64, xt64, w64, wt64 = (t.double().cpu() for t in (xs, xt, ws, wt))  # the bf16 inputs, widened
    w64.requires_grad_()
    exact = torch.autograd.grad(nitrobrew.reference.fused_linear(x64, xt64, w64, wt64, beta=0.4, labels=labels.cpu()),
                                w64)[0]
    errors = {}
    for path, kw in (("training", dict(grad_in_forward=True, grad_chunk_mib=1)),
                     ("recompute", dict(grad_in_forward=False))):
        w = ws.clone().requires_grad_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            (dws,) = torch.autograd.grad(nitrobrew.jsd(xs, xt, w, wt, beta=0.4, labels=labels, **kw), w)
        assert ("nitrobrew::accumulate_grad" in {e.name for e in prof.events()}) == (path == "training")
        errors[path] = ((dws.double().cpu() - exact).norm() / exact.norm()).item()
    assert errors["training"] <= 1.5 * errors["recompute"], errors


def test_bad_options_are_clear_errors():
    xs, xt, ws, wt, labels = _problem("cpu")
    with pytest.raises(ValueError, match="grad_in_forward=True needs a scalar loss"):
        nitrobrew.forward_kl(xs, xt, ws, wt, reduction="none", grad_in_forward=True)
    with pytest.raises(TypeError, match="grad_in_forward must be None"):
        nitrobrew.forward_kl(xs, xt, ws, wt, grad_in_forward="yes")
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="grad_chunk_mib must be a positive int"):
            nitrobrew.forward_kl(xs, xt, ws, wt, grad_chunk_mib=bad)
    with pytest.raises(TypeError, match="grad_in_forward must be None"):
        nitrobrew.DistillationLoss("jsd", grad_in_forward=1)
    with pytest.raises(ValueError, match="grad_chunk_mib must be a positive int"):
        nitrobrew.DistillationLoss("jsd", grad_chunk_mib=0)
    # Forced on where no gradient is wanted: nothing to form, the plain forward runs.
    with torch.no_grad():
        assert ops_run(lambda: nitrobrew.forward_kl(xs, xt, ws, wt, grad_in_forward=True)) == {FORWARD_OP}


def _grads(loss_fn, xs, ws, *extra):
    leaves = [t.detach().clone().requires_grad_() for t in (xs, ws, *extra)]
    loss = loss_fn(*leaves)
    return (loss.detach(), *torch.autograd.grad(loss, leaves))


def _assert_same(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)


def test_module_takes_the_path_options(device):
    xs, xt, ws, wt, labels = _problem(device)
    for path in (True, False):
        module = nitrobrew.DistillationLoss("reverse_kl", grad_in_forward=path, grad_chunk_mib=1)
        expected = CHUNK_OP if path else FORWARD_OP
        assert ops_run(lambda: module(xs, xt, ws, wt, labels)) == {expected}


def test_forward_without_backward(device):
    # Evaluating a loss under grad mode without ever calling backward forms the gradients anyway (that
    # is the path's cost: four products where a forward needs two). They are freed with the graph, and
    # the next step is unaffected. torch.no_grad() (or grad_in_forward=False) avoids the cost.
    xs, xt, ws, wt, labels = _problem(device)
    losses = [nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, grad_in_forward=True) for _ in range(3)]
    with torch.no_grad():
        plain = nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels)
    for loss in losses:
        torch.testing.assert_close(loss.detach(), plain)
    del losses
    loss = nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels, grad_in_forward=True)
    loss.backward()
    assert xs.grad is not None and ws.grad is not None


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(device, reentrant):
    # Under torch.utils.checkpoint the loss's forward runs twice: non-reentrant checkpointing records it
    # with grad mode on (the training path, its saved gradients dropped and formed again when the
    # backward needs them), reentrant checkpointing first runs it under no_grad (the plain forward),
    # then again inside the backward (the training path). Either way the gradients are the plain ones.
    xs, xt, ws, wt, labels = _problem(device)

    def step(a, b):
        return nitrobrew.jsd(torch.tanh(a), xt, b, wt, beta=0.3, labels=labels, ce_weight=0.2, grad_in_forward=True)

    def recompute(a, b):
        return nitrobrew.jsd(torch.tanh(a), xt, b, wt, beta=0.3, labels=labels, ce_weight=0.2, grad_in_forward=False)

    def checkpointed(a, b):
        return torch.utils.checkpoint.checkpoint(step, a, b, use_reentrant=reentrant)

    results = []
    for fn in (checkpointed, recompute):
        a, b = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
        loss = fn(a, b)
        loss.backward()  # (reentrant checkpointing takes no torch.autograd.grad)
        results.append((loss.detach(), a.grad, b.grad))
    _assert_same(*results, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_over_micro_batches(device):
    # Each micro-batch's backward adds its gradients into .grad, as with any autograd op.
    xs, xt, ws, wt, labels = _problem(device)
    halves = [slice(0, 20), slice(20, 45)]
    a, b = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    for h in halves:
        (nitrobrew.forward_kl(a[h], xt[h], b, wt, labels=labels[h], reduction="sum", grad_in_forward=True) / 2).backward()
    a_ref, b_ref = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
    for h in halves:
        (nitrobrew.forward_kl(a_ref[h], xt[h], b_ref, wt, labels=labels[h], reduction="sum",
                              grad_in_forward=False) / 2).backward()
    _assert_same((a.grad, b.grad), (a_ref.grad, b_ref.grad), rtol=1e-5, atol=1e-6)


def test_tied_embeddings(device):
    # The student's embedding is its lm_head (Qwen2 small models, Gemma): autograd adds the loss's dws
    # to the embedding lookup's gradient.
    xs, xt, ws, wt, labels = _problem(device)
    ids = torch.randint(0, 700, (45,), device=device)
    grads = []
    for path in (True, False):
        emb = ws.detach().clone().requires_grad_()
        h = torch.tanh(emb[ids] * 3.0)  # a "decoder" over the tied embedding
        nitrobrew.reverse_kl(h, xt, emb, wt, labels=labels, grad_in_forward=path).backward()
        grads.append(emb.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_saved_tensor_hooks_see_the_gradients(device):
    # The gradients are the tensors the training path saves: saved-tensor hooks (CPU offloading with
    # torch.autograd.graph.save_on_cpu, or any pack/unpack pair) receive them, and the backward uses
    # what unpack returns.
    xs, xt, ws, wt, labels = _problem(device)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t.clone()

    def loss(a, b):
        return nitrobrew.forward_kl(a, xt, b, wt, labels=labels, grad_in_forward=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ours = _grads(loss, xs, ws)
    assert tuple(xs.shape) in packed and tuple(ws.shape) in packed
    with torch.autograd.graph.save_on_cpu():
        offloaded = _grads(loss, xs, ws)
    plain = _grads(loss, xs, ws)
    _assert_same(ours, plain, rtol=0, atol=0)
    _assert_same(offloaded, plain, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_upstream_gradient_scales_the_saved_gradients(device, dtype):
    # The backward multiplies by the upstream gradient: a power of two (loss.backward(), loss scaling)
    # scales the gradients exactly.
    xs, xt, ws, wt, labels = make_problem(n=45, v=700, device=device, masked=True, dtype=dtype)
    bias_s, _ = make_biases(ws, wt)
    grads = []
    for g in (1.0, 0.25, 1024.0):
        a, b, c = (t.detach().clone().requires_grad_() for t in (xs, ws, bias_s))
        loss = nitrobrew.forward_kl(a, xt, b, wt, labels=labels, bias_s=c, grad_in_forward=True)
        loss.backward(torch.tensor(g, dtype=loss.dtype, device=device))
        grads.append((a.grad / g, b.grad / g, c.grad / g))
    for other in grads[1:]:
        _assert_same(other, grads[0], rtol=0, atol=0)


@CUDA
def test_training_path_is_deterministic():
    xs, xt, ws, wt, labels = make_problem(n=300, v=20011, d_s=64, d_t=96, device="cuda", dtype=torch.bfloat16,
                                          masked=True)
    runs = [_grads(lambda a, b: nitrobrew.jsd(a, xt, b, wt, beta=0.5, labels=labels, grad_in_forward=True,
                                              grad_chunk_mib=8), xs, ws)
            for _ in range(2)]
    _assert_same(runs[0], runs[1], rtol=0, atol=0)


@CUDA
def test_float16_dws_of_many_tokens_stays_in_range():
    # float16 G is stored at about the size of an unscaled one; dws sums it over every token, so the
    # range scale is taken out through the hidden states: with 16384 tokens, a hidden unit of 8 on every
    # token and a teacher sure of token 0, dws[0] is ~-7 per unit of the mean, which the scale (2^14) would
    # take past float16's largest value.
    n, v, d = 16384, 512, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = torch.randn(n, d, device="cuda", generator=g)
    xs[:, 0] = 8.0
    xt = torch.randn(n, d, device="cuda", generator=g)
    xt[:, 0] = 1.0
    ws = torch.randn(v, d, device="cuda", generator=g) / 8
    wt = torch.randn(v, d, device="cuda", generator=g) / 8
    wt[0, 0] = 20.0  # the teacher's logit of token 0 is ~20 on every row
    xs, xt, ws, wt = (t.half() for t in (xs, xt, ws, wt))
    grads = [_grads(lambda a, b: nitrobrew.forward_kl(a, xt, b, wt, grad_in_forward=path), xs, ws)
             for path in (True, False)]
    assert grads[1][2].abs().max() > 1, "the test should reach a dws the scale would overflow"
    assert all(torch.isfinite(t).all() for t in grads[0])
    _assert_same(grads[0], grads[1], rtol=2e-2, atol=1e-3)
