"""What each rank runs in the DTensor tests: lm_head weights sharded on dim 0 as tensor parallelism
(xs replicated) and FSDP2 (each rank's own tokens) leave them, against the single-process loss."""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import nitrobrew
from nitrobrew import reference
from vocab_parallel_cases import _close, _device, _inputs


def _dtype_and_tolerance():
    """float64 on the CPU, to rounding; float32 on CUDA (its kernels take no float64), to the float32
    shards' tolerance."""
    return (torch.float64, 1e-12) if _device() == "cpu" else (torch.float32, 2e-5)


def tensor_parallel(rank: int, world: int) -> None:
    """ws, wt, bias_s DTensors Shard(0), xs a replicated DTensor: every rank's loss and xs.grad are the
    whole vocabulary's, ws.grad the rank's shard of the single-process gradient."""
    device, (dtype, tol) = _device(), _dtype_and_tolerance()
    mesh = init_device_mesh(device, (world,))
    xs, xt, ws, wt, bias_s, bias_t, labels, upstream = _inputs(dtype, device=device)
    # Both paths (the training path: the gradients formed in the forward; automatic for training).
    paths = (False, True)
    for (divergence, options), path in itertools.product(
            (("forward_kl", {"labels": labels, "ce_weight": 0.5}),
             ("jsd", {"beta": 0.3, "bias_s": bias_s, "bias_t": bias_t})), paths):
        options = dict(options, grad_in_forward=path)
        fn = getattr(nitrobrew, divergence)
        x = xs.clone().requires_grad_()
        w = ws.clone().requires_grad_()
        b = options.get("bias_s")
        whole_options = dict(options, bias_s=b.clone().requires_grad_()) if b is not None else options
        whole = fn(x, xt, w, wt, **whole_options)
        whole.backward()
        x_d = distribute_tensor(xs.clone(), mesh, [Replicate()]).requires_grad_()
        w_d = distribute_tensor(ws.clone(), mesh, [Shard(0)]).requires_grad_()
        sharded_options = dict(options)
        if b is not None:
            sharded_options["bias_s"] = distribute_tensor(b.clone(), mesh, [Shard(0)]).requires_grad_()
            sharded_options["bias_t"] = distribute_tensor(options["bias_t"].clone(), mesh, [Shard(0)])
        loss, entropy = fn(x_d, distribute_tensor(xt, mesh, [Replicate()]), w_d,
                           distribute_tensor(wt, mesh, [Shard(0)]), return_entropy=True, **sharded_options)
        loss.backward()
        what = f"rank {rank}/{world} {device} tensor parallel {divergence} grad_in_forward={path}"
        _close(loss.detach(), whole.detach(), tol, f"{what}: loss")
        # Every token's student entropy on every rank, over the whole vocabulary.
        _close(entropy, reference.student_entropy(xs, ws, labels=options.get("labels"), bias_s=b, dtype=None), tol,
               f"{what}: entropy")
        _close(x_d.grad.to_local(), x.grad, tol, f"{what}: xs.grad")
        _close(w_d.grad.full_tensor(), w.grad, tol, f"{what}: ws.grad")
        if b is not None:
            _close(sharded_options["bias_s"].grad.full_tensor(), whole_options["bias_s"].grad, tol,
                   f"{what}: bias_s.grad")


def layouts(rank: int, world: int) -> None:
    """Layouts the loss does not take raise a ValueError naming the argument."""
    mesh = init_device_mesh("cpu", (world,))
    xs, xt, ws, wt, *_ = _inputs(torch.float64)
    cases = {
        "sharded on dim 1": (xs, xt, distribute_tensor(ws, mesh, [Shard(1)]), wt, "ws must be sharded on dim 0"),
        "student whole, teacher sharded": (xs, xt, ws, distribute_tensor(wt, mesh, [Shard(0)]), "wt is a DTensor"),
        "xs sharded": (distribute_tensor(xs, mesh, [Shard(0)]), xt, distribute_tensor(ws, mesh, [Shard(0)]), wt,
                       "xs must be a plain tensor"),
    }
    for name, (x, x_t, w, w_t, message) in cases.items():
        try:
            nitrobrew.forward_kl(x, x_t, w, w_t)
        except ValueError as error:
            assert message in str(error), f"{name}: {error}"
        else:
            raise AssertionError(f"{name}: no error")


def data_parallel(rank: int, world: int) -> None:
    """FSDP2's layout without a model: ws, wt, bias_s DTensors Shard(0), each rank its own tokens (of its own
    count, some masked), on both paths. Every rank's loss and xs.grad are those of its own tokens' loss
    over the whole vocabulary; ws.grad and bias_s.grad the ranks' average of their losses' gradients, as
    FSDP2 averages. Then the training path refuses upstream gradients that differ across the ranks, on every
    rank alike, where the recompute path takes them."""
    device, (dtype, tol) = _device(), _dtype_and_tolerance()
    mesh = init_device_mesh(device, (world,))
    _, _, ws, wt, bias_s, bias_t, *_ = _inputs(dtype, device=device)
    # Each rank's own tokens, of its own count; with 3 ranks rank 1 holds none, with 2 rank 1's are all masked.
    tokens = [_inputs(dtype, n=0 if (world, r) == (3, 1) else 11 + 6 * r, seed=1 + r, device=device)
              for r in range(world)]
    if world == 2:
        tokens[1][6].fill_(-100)
    cases = (("forward_kl", {"ce_weight": 0.5, "reduction": "mean"}),
             ("jsd", {"beta": 0.3, "bias_s": bias_s, "bias_t": bias_t, "reduction": "sum"}))
    for (divergence, options), path in itertools.product(cases, (False, True)):
        fn = getattr(nitrobrew, divergence)
        what = f"rank {rank}/{world} {device} data parallel {divergence} grad_in_forward={path}"
        # The expected: each rank's loss alone over the whole vocabulary; the weights' gradients averaged.
        w_grad, b_grad = torch.zeros_like(ws), torch.zeros_like(bias_s)
        for r, (xs, xt, _, _, _, _, labels, _) in enumerate(tokens):
            x, w, b = xs.clone().requires_grad_(), ws.clone().requires_grad_(), bias_s.clone().requires_grad_()
            whole = fn(x, xt, w, wt, labels=labels, **dict(options, bias_s=b if "bias_s" in options else None))
            whole.backward()
            w_grad += w.grad / world
            b_grad += b.grad / world if b.grad is not None else 0
            if r == rank:
                expected_loss, expected_xs_grad = whole.detach(), x.grad
                expected_entropy = reference.student_entropy(
                    xs, ws, labels=labels, bias_s=bias_s if "bias_s" in options else None, dtype=None)
        xs, xt, _, _, _, _, labels, _ = tokens[rank]
        x = xs.clone().requires_grad_()
        w_d = distribute_tensor(ws.clone(), mesh, [Shard(0)]).requires_grad_()
        sharded = dict(options, grad_in_forward=path)
        if "bias_s" in options:
            sharded["bias_s"] = distribute_tensor(bias_s.clone(), mesh, [Shard(0)]).requires_grad_()
            sharded["bias_t"] = distribute_tensor(bias_t, mesh, [Shard(0)])
        loss, entropy = fn(x, xt, w_d, distribute_tensor(wt, mesh, [Shard(0)]), labels=labels, return_entropy=True,
                           **sharded)
        loss.backward()
        _close(loss.detach(), expected_loss, tol, f"{what}: loss")
        # Each rank's own tokens' student entropy over the whole vocabulary (none on a rank without tokens).
        assert entropy.shape == xs.shape[:1] and not entropy.requires_grad, f"{what}: entropy {entropy.shape}"
        _close(entropy, expected_entropy, tol, f"{what}: entropy")
        _close(x.grad, expected_xs_grad, tol, f"{what}: xs.grad")
        _close(w_d.grad.full_tensor(), w_grad, tol, f"{what}: ws.grad")
        if "bias_s" in options:
            _close(sharded["bias_s"].grad.full_tensor(), b_grad, tol, f"{what}: bias_s.grad")
        # Each rank's loss scaled by its own factor: the training path cannot weight dws by it.
        x = xs.clone().requires_grad_()
        w_d = distribute_tensor(ws.clone(), mesh, [Shard(0)]).requires_grad_()
        loss = fn(x, xt, w_d, distribute_tensor(wt, mesh, [Shard(0)]), labels=labels, **sharded)
        try:
            (loss * (rank + 1)).backward()
        except RuntimeError as error:
            assert path and "same upstream gradient on every rank" in str(error), f"{what}: {error}"
        else:
            assert not path, f"{what}: upstream gradients that differ across ranks: no error"
        # The last rank's xs needs no gradient: the others' xs.grad still take their sum (no rank waits).
        x = xs.clone().requires_grad_(rank != world - 1)
        w_d = distribute_tensor(ws.clone(), mesh, [Shard(0)]).requires_grad_()
        fn(x, xt, w_d, distribute_tensor(wt, mesh, [Shard(0)]), labels=labels, **sharded).backward()
        _close(w_d.grad.full_tensor(), w_grad, tol, f"{what}, one rank's xs without gradient: ws.grad")
        if rank != world - 1:
            _close(x.grad, expected_xs_grad, tol, f"{what}, one rank's xs without gradient: xs.grad")


def data_parallel_topk(rank: int, world: int) -> None:
    """Top-K (normalize="full") in FSDP2's layout: ws, bias_s DTensors Shard(0), each rank its own tokens and
    teacher top-K, on both paths, against each rank's loss alone and the ranks' average of the weights'
    gradients."""
    from vocab_parallel_cases import _teacher

    device, (dtype, tol) = _device(), _dtype_and_tolerance()
    mesh = init_device_mesh(device, (world,))
    _, _, ws, _, bias_s, *_ = _inputs(dtype, device=device)
    tokens = []
    for r in range(world):  # each rank's own tokens, of its own count
        xs, _, _, _, _, _, labels, _ = _inputs(dtype, n=9 + 5 * r, seed=1 + r, device=device)
        ids, logprobs = (t.to(device) for t in _teacher(xs.shape[0], 6, seed=20 + r))
        tokens.append((xs, ids, logprobs.to(dtype), labels))
    options = dict(normalize="full", temperature=1.5, reduction="mean")
    for path in (False, True):
        what = f"rank {rank}/{world} {device} data parallel topk grad_in_forward={path}"
        w_grad, b_grad = torch.zeros_like(ws), torch.zeros_like(bias_s)
        for r, (xs, ids, logprobs, labels) in enumerate(tokens):
            x, w, b = xs.clone().requires_grad_(), ws.clone().requires_grad_(), bias_s.clone().requires_grad_()
            whole = nitrobrew.topk_kl(x, w, ids, logprobs, labels=labels, bias_s=b, **options)
            whole.backward()
            w_grad += w.grad / world
            b_grad += b.grad / world
            if r == rank:
                expected_loss, expected_xs_grad = whole.detach(), x.grad
        xs, ids, logprobs, labels = tokens[rank]
        x = xs.clone().requires_grad_()
        w_d = distribute_tensor(ws.clone(), mesh, [Shard(0)]).requires_grad_()
        b_d = distribute_tensor(bias_s.clone(), mesh, [Shard(0)]).requires_grad_()
        loss = nitrobrew.topk_kl(x, w_d, ids, logprobs, labels=labels, bias_s=b_d, grad_in_forward=path, **options)
        loss.backward()
        _close(loss.detach(), expected_loss, tol, f"{what}: loss")
        _close(x.grad, expected_xs_grad, tol, f"{what}: xs.grad")
        _close(w_d.grad.full_tensor(), w_grad, tol, f"{what}: ws.grad")
        _close(b_d.grad.full_tensor(), b_grad, tol, f"{what}: bias_s.grad")
        w_d = distribute_tensor(ws.clone(), mesh, [Shard(0)]).requires_grad_()
        loss = nitrobrew.topk_kl(xs, w_d, ids, logprobs, labels=labels, grad_in_forward=path, **options)
        try:  # each rank's loss scaled by its own factor: refused by the training path alone
            (loss * (rank + 1)).backward()
        except RuntimeError as error:
            assert path and "same upstream gradient on every rank" in str(error), f"{what}: {error}"
        else:
            assert not path, f"{what}: upstream gradients that differ across ranks: no error"


def fsdp2_tiny_llama(rank: int, world: int) -> None:
    """A tiny Hugging Face student under FSDP2 (its decoder and its lm_head units of their own: the
    decoder runs alone, and the lm_head's weight stays sharded), each rank with its own tokens: nitrobrew's
    loss from the decoder's hidden states and the sharded lm_head equals the loss from the model's own
    logits, and so do the gradients FSDP2 leaves on every parameter (ws.grad averaged over the ranks as
    FSDP2 averages). float64 on the CPU; float32 on CUDA, where the gradients pass through the decoder's
    float32 backward after the loss's."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    from nitrobrew import reference

    vocab = 67  # shards of 34 and 33 rows on 2 ranks
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    device, (dtype, tol) = _device(), _dtype_and_tolerance()
    base = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        base.lm_head.weight.mul_(8.0)
    teacher = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    mesh = init_device_mesh(device, (world,))
    g = torch.Generator().manual_seed(10 + rank)  # each rank's own tokens, of its own count
    input_ids = torch.randint(0, vocab, (2, 9 + rank), generator=g).to(device)

    def shard(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model.model, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    with torch.no_grad():
        zt = teacher(input_ids=input_ids).logits[:, :-1]
        ht = teacher.model(input_ids=input_ids).last_hidden_state[:, :-1]
    usual = shard(copy.deepcopy(base))
    zs = usual(input_ids=input_ids).logits[:, :-1]
    expected = reference.logits(zs, zt, beta=0.0)
    expected.backward()

    for path in (None, True):  # the automatic choice (the recompute path here) and the training path
        fused = shard(copy.deepcopy(base))
        hs = fused.model(input_ids=input_ids).last_hidden_state[:, :-1]
        assert isinstance(fused.lm_head.weight, DTensor)
        loss = nitrobrew.forward_kl(hs, ht, fused.lm_head.weight, teacher.lm_head.weight, grad_in_forward=path)
        loss.backward()

        what = f"rank {rank}/{world} {device} FSDP2 grad_in_forward={path}"
        _close(loss.detach(), expected.detach(), 10 * tol, f"{what}: loss")
        for (name, p_usual), (_, p_fused) in zip(usual.named_parameters(), fused.named_parameters()):
            _close(p_fused.grad.to_local(), p_usual.grad.to_local(), 100 * tol, f"{what}: {name}.grad")


def hf_refuses_tensor_parallel_lm_heads(rank: int, world: int) -> None:
    """nitrobrew.hf takes FSDP2 models (tests/hf/test_hf_distributed.py), not an lm_head that is a DTensor outside
    FSDP2 (tensor parallelism): a clear error naming the losses that take DTensor weights, not a wrong loss."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    student = transformers.AutoModelForCausalLM.from_config(config)
    teacher = transformers.AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (world,))
    student.lm_head.weight = torch.nn.Parameter(distribute_tensor(student.lm_head.weight.detach(), mesh, [Shard(0)]))
    try:
        nitrobrew.hf.distillation_loss(student, teacher, torch.randint(0, 64, (1, 8)))
    except NotImplementedError as error:
        assert "tensor parallelism" in str(error) and "forward_kl" in str(error), error
    else:
        raise AssertionError("no error")


def fsdp2_bad_batch_is_skipped(rank: int, world: int) -> None:
    """In data parallelism each rank's labels differ: a bad label on one rank raises on every rank alike
    (the check reads the gathered labels), so a loop that skips the batch stays in step."""
    device, (dtype, _) = _device(), _dtype_and_tolerance()
    mesh = init_device_mesh(device, (world,))
    xs, xt, ws, wt, *_ = _inputs(dtype, device=device)
    w_d = distribute_tensor(ws, mesh, [Shard(0)])
    labels = torch.zeros(xs.shape[0], dtype=torch.int64, device=device)
    if rank == 1:
        labels[3] = 10_000
    for path in (False, True):  # the training path's check reads the gathered labels too
        x = xs.clone().requires_grad_()
        try:
            nitrobrew.forward_kl(x, xt, w_d, wt, labels=labels, ce_weight=1.0, grad_in_forward=path)
        except IndexError as error:
            assert "labels" in str(error), error
        else:
            raise AssertionError(f"rank {rank} grad_in_forward={path}: no error")
        # the next batch
        loss = nitrobrew.forward_kl(x, xt, w_d, wt, labels=torch.zeros_like(labels), ce_weight=1.0,
                                    grad_in_forward=path)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def fsdp2_bad_teacher_mass_is_skipped(rank: int, world: int) -> None:
    """The top-K teacher's mass check reads the gathered tokens too: probabilities passed as log-probabilities on one
    rank raise on every rank alike, instead of leaving the others in the token all-gather."""
    device, (dtype, _) = _device(), _dtype_and_tolerance()
    mesh = init_device_mesh(device, (world,))
    xs, _, ws, *_ = _inputs(dtype, device=device)
    w_d = distribute_tensor(ws, mesh, [Shard(0)])
    ids = torch.arange(2, device=device).repeat(xs.shape[0], 1)
    logprobs = torch.full((xs.shape[0], 2), -1.0, dtype=dtype, device=device)
    bad = logprobs.clone()
    if rank == 1:
        bad[3] = 0.5
    try:
        nitrobrew.topk_kl(xs.clone().requires_grad_(), w_d, ids, bad)
    except ValueError as error:
        assert "teacher_logprobs must be log-probabilities" in str(error), error
    else:
        raise AssertionError(f"rank {rank}: no error")
    x = xs.clone().requires_grad_()  # the next batch
    loss = nitrobrew.topk_kl(x, w_d, ids, logprobs)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def process_group_and_dtensors_refused(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    xs, xt, ws, wt, *_ = _inputs(torch.float64)
    try:
        nitrobrew.forward_kl(xs, xt, distribute_tensor(ws, mesh, [Shard(0)]), wt, process_group=dist.group.WORLD)
    except ValueError as error:
        assert "without process_group" in str(error), error
    else:
        raise AssertionError("no error")
