"""The operator layer: opcheck, fp64 gradcheck, torch.compile, the module, and that no
[N x V] buffer is ever allocated."""

import pytest
import torch

import nitrobrew
from conftest import CUDA
from helpers import divergence_of, make_biases, make_problem, nitrobrew_loss

OPTIONS = [  # (beta, ce_weight, softcaps, vocab_size, model: biases and logit scales)
    (0.0, 0.0, None, None, False),
    (0.5, 0.0, None, None, True),
    (1.0, 0.5, (3.0, 4.0), 11, False),
    (0.3, 0.5, (3.0, None), 12, True),
]


def _biases(ws, wt, model):
    if not model:
        return None, None, 1.0, 1.0
    bias_s, bias_t = make_biases(ws, wt)
    return bias_s, bias_t, 0.6, 1.8


def _op_args(xs, xt, ws, wt, labels, beta, ce_weight, softcaps, vocab_size, model=False, chunk_v=4):
    cap_s, cap_t = softcaps or (None, None)
    bias_s, bias_t, scale_s, scale_t = _biases(ws, wt, model)
    return (xs, xt, ws, wt, labels, bias_s, bias_t, -100, divergence_of(beta), beta, 1.3, ce_weight, cap_s, cap_t,
            scale_s, scale_t, vocab_size or ws.shape[0], chunk_v)


@pytest.mark.parametrize("beta,ce_weight,softcaps,vocab_size,model", OPTIONS)
def test_opcheck_forward(device, beta, ce_weight, softcaps, vocab_size, model):
    xs, xt, ws, wt, labels = make_problem(n=7, v=12, d_s=5, d_t=6, device=device, masked=True, rows_s=13, rows_t=12)
    labels = labels.clamp(max=10) if ce_weight else None
    xs.requires_grad_()
    ws.requires_grad_()
    args = _op_args(xs, xt, ws, wt, labels, beta, ce_weight, softcaps, vocab_size or 12, model)
    if model:
        args[5].requires_grad_()
    torch.library.opcheck(torch.ops.nitrobrew.fused_linear_fwd.default, args)


@pytest.mark.parametrize("model", [False, True])
def test_opcheck_with_entropy(device, model):
    # The forward-only option `entropy`: the recompute forward's row statistics carry it (its backward takes
    # the other options), and the training path's step returns it as a third output.
    xs, xt, ws, wt, labels = make_problem(n=7, v=12, d_s=5, d_t=6, device=device, masked=True, rows_s=13, rows_t=13)
    xs.requires_grad_()
    ws.requires_grad_()
    args = _op_args(xs, xt, ws, wt, labels, 0.3, 0.0, (3.0, 4.0) if model else None, 12, model)
    torch.library.opcheck(torch.ops.nitrobrew.fused_linear_fwd.default, (*args, True))
    chunk_args = (*args[:7], torch.tensor(0.25, device=device), *args[7:-1], 5, True)
    torch.library.opcheck(torch.ops.nitrobrew.fused_linear_grad_chunk.default,
                          tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in chunk_args))


@pytest.mark.parametrize("compute", [(True, True, True), (True, False, False), (False, True, False),
                                     (False, False, True)])
@pytest.mark.parametrize("model", [False, True])
def test_opcheck_backward(device, compute, model):
    xs, xt, ws, wt, labels = make_problem(n=7, v=12, d_s=5, d_t=6, device=device, masked=True)
    args = _op_args(xs, xt, ws, wt, labels, 0.3, 0.5, (3.0, 4.0), None, model)
    _, row_stats = torch.ops.nitrobrew.fused_linear_fwd(*args)
    grad = torch.randn(7, device=device)
    bwd_args = (grad, *args[:7], row_stats, *args[7:], *compute)
    torch.library.opcheck(torch.ops.nitrobrew.fused_linear_bwd.default, bwd_args)


@pytest.mark.parametrize("beta,ce_weight,softcaps,vocab_size,model", OPTIONS)
@pytest.mark.parametrize("product_rows", [3, 512])
def test_opcheck_training_path_chunk(device, beta, ce_weight, softcaps, vocab_size, model, product_rows):
    # The training path's step: its fake gives the real outputs' shapes, dtypes and padded strides.
    xs, xt, ws, wt, labels = make_problem(n=7, v=12, d_s=5, d_t=6, device=device, masked=True, rows_s=13, rows_t=13)
    labels = labels.clamp(max=10) if ce_weight else labels
    args = _op_args(xs, xt, ws, wt, labels, beta, ce_weight, softcaps, vocab_size or 12, model)
    row_scale = torch.tensor(0.25, device=device)
    chunk_args = (*args[:7], row_scale, *args[7:-1], product_rows)
    torch.library.opcheck(torch.ops.nitrobrew.fused_linear_grad_chunk.default, chunk_args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1])  # an unaligned start takes the CUDA kernel's fallback
def test_scaled(device, dtype, offset):
    # The training path's backward scaling: x times a scalar tensor in float32, one rounding.
    x = torch.randn(1000 + offset, device=device).to(dtype)[offset:]
    factor = torch.tensor(0.3, device=device)
    torch.testing.assert_close(torch.ops.nitrobrew.scaled(x, factor), (x.float() * 0.3).to(dtype), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.nitrobrew.scaled.default, (x, factor))


@pytest.mark.parametrize("beta,ce_weight,softcaps,vocab_size,model", OPTIONS)
def test_gradcheck_float64(beta, ce_weight, softcaps, vocab_size, model):
    xs, xt, ws, wt, labels = make_problem(n=5, v=13, d_s=3, d_t=4, dtype=torch.float64, masked=True, seed=3)
    labels = labels.clamp(max=10)
    cap_s, cap_t = softcaps or (None, None)
    bias_s, bias_t, scale_s, scale_t = _biases(ws, wt, model)
    bias_s = torch.zeros(13, dtype=torch.float64) if bias_s is None else bias_s

    def loss(xs, ws, bias_s):
        return nitrobrew_loss(xs, xt, ws, wt, beta=beta, temperature=0.7, labels=labels, ce_weight=ce_weight,
                              softcap_s=cap_s, softcap_t=cap_t, vocab_size=vocab_size, chunk_V=4, reduction="none",
                              bias_s=bias_s, bias_t=bias_t, logit_scale_s=scale_s, logit_scale_t=scale_t)

    torch.autograd.gradcheck(loss, (xs.requires_grad_(), ws.requires_grad_(), bias_s.requires_grad_()))


def test_torch_compile_dynamic_with_default_options(device):
    # Default float options (temperature=1.0, ...) once reached the argument checks as symbolic
    # floats under dynamic=True, and math.isfinite broke the graph.
    xs, xt, ws, wt, labels = make_problem(n=33, v=300, device=device, masked=True)

    def step(xs, ws):
        return nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(xs, ws), step(xs, ws))


def test_torch_compile_takes_any_token_count(device):
    # The automatic choice under torch.compile keeps to the recompute path, whose graph takes any number
    # of tokens (the training path's chunk loop would specialize on it and, past the recompile limit,
    # fail a fullgraph compile).
    torch._dynamo.reset()
    xs, xt, ws, wt, labels = make_problem(n=60, v=300, device=device, masked=True)

    def step(xs, xt, ws, wt, labels):
        return nitrobrew.forward_kl(xs, xt, ws, wt, labels=labels)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n in range(12, 60, 4):  # 12 token counts, past the recompile limit of 8
        a = xs[:n].clone().requires_grad_()
        loss = compiled(a, xt[:n], ws, wt, labels[:n])
        loss.backward()
        b = xs[:n].clone().requires_grad_()
        step(b, xt[:n], ws, wt, labels[:n]).backward()
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_in_forward", [False, True])  # the recompute path, the training path
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_torch_compile_fullgraph_with_backward(device, beta, dynamic, grad_in_forward):
    torch._dynamo.reset()  # each case's `step` is the same code object: no recompile limit across cases
    xs, xt, ws, wt, labels = make_problem(n=33, v=300, device=device, masked=True)

    bias_s, bias_t = make_biases(ws, wt)

    def step(xs, xt, ws, wt, labels, bias_s):
        loss = nitrobrew_loss(xs, xt, ws, wt, beta=beta, labels=labels, temperature=2.0, ce_weight=0.1,
                              bias_s=bias_s, bias_t=bias_t, logit_scale_s=0.5, logit_scale_t=1.5,
                              grad_in_forward=grad_in_forward)
        return loss * 2.0

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    results = []
    for fn in (step, compiled):
        a, b, c = xs.clone().requires_grad_(), ws.clone().requires_grad_(), bias_s.clone().requires_grad_()
        loss = fn(a, xt, b, wt, labels, c)
        loss.backward()
        results.append((loss.detach(), a.grad, b.grad, c.grad))
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager)


@pytest.mark.parametrize("loss_name,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.25)])
def test_module(device, loss_name, beta):
    xs, xt, ws, wt, labels = make_problem(device=device, masked=True)
    weight = {"beta": beta} if loss_name == "jsd" else {}
    module = nitrobrew.DistillationLoss(loss_name, **weight, temperature=2.0, ce_weight=0.1)
    expected = nitrobrew_loss(xs, xt, ws, wt, beta=beta, temperature=2.0, ce_weight=0.1, labels=labels)
    torch.testing.assert_close(module(xs, xt, ws, wt, labels), expected)
    assert loss_name in repr(module)
    with pytest.raises(ValueError, match="loss must be one of"):
        nitrobrew.DistillationLoss("kl")
    with pytest.raises(ValueError, match="temperature must be a positive"):
        nitrobrew.DistillationLoss("jsd", temperature=0.0)
    with pytest.raises(ValueError, match="beta must be a number in"):
        nitrobrew.DistillationLoss("jsd", beta=2.0)
    # A weight the loss does not take would be ignored: an error, at construction and in nitrobrew.hf.
    with pytest.raises(ValueError, match="beta is the weight of 'jsd' only, got it with 'forward_kl'"):
        nitrobrew.DistillationLoss("forward_kl", beta=0.9)
    with pytest.raises(ValueError, match="alpha is the weight of 'skew_forward_kl' and 'skew_reverse_kl' only"):
        nitrobrew.DistillationLoss("jsd", alpha=0.9)
    with pytest.raises(ValueError, match="beta is the weight of 'jsd' only, got it with 'skew_forward_kl'"):
        nitrobrew.DistillationLoss("skew_forward_kl", beta=0.9)


@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_no_buffer_of_tokens_times_vocab_is_allocated(grad_in_forward):
    # With 512 tokens and a 20000-entry vocabulary the logits would take 39 MiB per model in
    # float32. The recompute path's working set is bounded by its tiles (here 512 x 256); the training
    # path's by grad_chunk_mib (here 4 MiB: its products and dLoss/dz of a few dozen tokens at a time).
    n, v = 512, 20000
    xs, xt, ws, wt, labels = make_problem(n=n, v=v, d_s=16, d_t=8, masked=True)
    xs.requires_grad_()
    ws.requires_grad_()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = nitrobrew.jsd(xs, xt, ws, wt, labels=labels, ce_weight=0.5, chunk_V=256, grad_in_forward=grad_in_forward,
                             grad_chunk_mib=4)
        loss.backward()
    allocations = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocations, "the profiler recorded no allocation: the test would be vacuous"
    largest = max(allocations)
    assert largest < n * v * 4 / 8, f"an allocation of {largest} bytes is O(N x V)"
    assert largest >= ws.numel() * 4, "dws itself ([V, D_s]) should be among the allocations seen"
    if grad_in_forward:
        assert largest <= 4 << 20, f"an allocation of {largest} bytes is over grad_chunk_mib"


@CUDA
@pytest.mark.parametrize("grad_in_forward", [False, True])
def test_cuda_graph_capture_of_forward_and_backward(grad_in_forward):
    # No host synchronization inside the ops, on either path: a whole step can be captured and replayed.
    xs, xt, ws, wt, labels = make_problem(device="cuda", dtype=torch.bfloat16, masked=True)
    xs.requires_grad_()
    ws.requires_grad_()

    def step():
        loss = nitrobrew.jsd(xs, xt, ws, wt, labels=labels, beta=0.5, ce_weight=0.1, grad_in_forward=grad_in_forward)
        return (loss,) + torch.autograd.grad(loss, (xs, ws))

    side = torch.cuda.Stream()  # warm up off the default stream, as torch.cuda.graph requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    for a, b in zip(captured, eager):
        torch.testing.assert_close(a, b)
