"""Shared harness for the issue-44 experiments: gloo ranks on CPU, tiny HF models, FSDP2 wrapping patterns,
ways to get the final hidden states, and an oracle (plain models, per-rank logits loss, grads averaged)."""
from __future__ import annotations

import copy
import datetime
import os
import sys
import tempfile
import traceback
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))  # the checkout
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = 67
DTYPE = torch.float64


def _worker(rank, world, init_file, fn, args):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)


def run(fn, *args, world=2):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "rdv"), fn, args), nprocs=world, join=True)


def config(arch):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if arch == "llama":
        return transformers.LlamaConfig(tie_word_embeddings=False, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True, **common)
    if arch == "gemma2":
        return transformers.Gemma2Config(tie_word_embeddings=True, head_dim=8, final_logit_softcapping=30.0,
                                         sliding_window=4, **common)
    raise ValueError(arch)


def models(arch, seed=0):
    import transformers
    torch.manual_seed(seed)
    cfg = config(arch)
    base = transformers.AutoModelForCausalLM.from_config(cfg).to(DTYPE)
    with torch.no_grad():
        base.get_output_embeddings().weight.mul_(8.0)  # sharper distributions
    teacher = transformers.AutoModelForCausalLM.from_config(cfg).to(DTYPE).eval()
    return base, teacher


def rank_ids(r):
    g = torch.Generator().manual_seed(10 + r)
    return torch.randint(0, VOCAB, (2, 9 + r), generator=g)


def tied(model):
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


# ---------------------------------------------------------------- wrapping patterns
def wrap(model, pattern, mesh):
    from torch.distributed.fsdp import fully_shard
    if pattern == "c":  # accelerate's own fsdp2_prepare_model, as TRL users get it
        return accelerate_wrap(model, mesh)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if pattern == "a":
        pass
    elif pattern == "b":
        fully_shard(model.model, mesh=mesh)
        fully_shard(model.lm_head, mesh=mesh)
    elif pattern == "b_head_only":  # lm_head its own unit, decoder leftovers in the root
        fully_shard(model.lm_head, mesh=mesh)
    elif pattern == "bt":  # tied: embed_tokens and lm_head one group, then the decoder
        fully_shard([model.model.embed_tokens, model.lm_head], mesh=mesh)
        fully_shard(model.model, mesh=mesh)
    else:
        raise ValueError(pattern)
    fully_shard(model, mesh=mesh)
    return model


def accelerate_wrap(model, mesh):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[type(model.model.layers[0]).__name__],
                                            reshard_after_forward=True)
    acc = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                mixed_precision="no", is_main_process=dist.get_rank() == 0,
                                device=torch.device("cpu"))
    return fsdp2_prepare_model(acc, model)


def fsdp_units(model):
    """[(module fqns of the group, [param fqns], reshard_after_forward)] for every FSDP state under model."""
    from torch.distributed.fsdp import FSDPModule
    seen, out = set(), []
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            st = m._get_fsdp_state()
            if id(st) in seen:
                continue
            seen.add(id(st))
            for g in st._fsdp_param_groups:
                out.append((g._module_fqn or name or "<root>", [fp._param_fqn for fp in g.fsdp_params],
                            g.post_forward_mesh_info is not None))
    return out


def sharded_param(model, module, name="weight"):
    """The FSDP-managed sharded DTensor parameter registered as module.<name> (or None)."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in m._get_fsdp_state()._fsdp_param_groups:
                for fp in g.fsdp_params:
                    mi = fp._module_info
                    owners = [(mi.module, mi.param_name)] + list(zip(mi.shared_modules, mi.shared_param_names))
                    if any(mod is module and n == name for mod, n in owners):
                        return fp.sharded_param
    return None


# ---------------------------------------------------------------- all-gather log
UNSHARDS = []
GROUPS = []


def gathered(param):
    """How many all-gathers since the log was cleared included this sharded parameter."""
    return sum(any(fp.sharded_param is param for fp in g.fsdp_params) for g in GROUPS)


def log_unshards():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    orig = FSDPParamGroup.unshard
    if getattr(orig, "_logged", False):
        return

    def unshard(self, *a, **k):
        if not self.is_unsharded and self._all_gather_result is None:
            UNSHARDS.append(self._module_fqn)
            GROUPS.append(self)
        return orig(self, *a, **k)
    unshard._logged = True
    FSDPParamGroup.unshard = unshard


# ---------------------------------------------------------------- ways to get final hidden states
def hs_direct(model, ids):
    return model.model(input_ids=ids, use_cache=False).last_hidden_state


def hs_root_hidden_states(model, ids):
    out = model(input_ids=ids, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    return out.hidden_states[-1]


def hs_root_hidden_states_last(model, ids):
    out = model(input_ids=ids, use_cache=False, logits_to_keep=1, output_hidden_states=-1)
    assert len([h for h in out.hidden_states if h is not None]) == 1, [h is None for h in out.hidden_states]
    return out.hidden_states[-1]


def hs_root_hook(model, ids):
    box = {}
    h = model.model.register_forward_hook(lambda m, a, o: box.__setitem__("h", o.last_hidden_state))
    try:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        h.remove()
    return box["h"]


def redirected(wrapper, inner, fn, *args, **kwargs):
    """TRL's _ForwardRedirection: run fn(*args, **kwargs) as inner's forward, called through wrapper's __call__
    (wrapper is inner itself for FSDP2, the DDP module for DDP), so the wrapper's hooks/forward run."""
    original = inner.forward

    def forward(*_a, **_k):
        inner.forward = original
        return fn(*_a, **_k)
    inner.forward = forward
    try:
        return wrapper(*args, **kwargs)
    finally:
        inner.forward = original


def hs_redirect(model, ids):
    return redirected(model, model, lambda i: model.model(input_ids=i, use_cache=False).last_hidden_state, ids)


METHODS = {"direct": hs_direct, "root_hs": hs_root_hidden_states, "root_hs_last": hs_root_hidden_states_last,
           "root_hook": hs_root_hook, "redirect": hs_redirect}


# ---------------------------------------------------------------- oracle
def oracle(base, teacher, world, rank):
    """(loss of this rank's tokens from full logits, {name: grad averaged over ranks}) on plain models."""
    from nitrobrew import reference
    grads, loss_r = {}, None
    for r in range(world):
        m = copy.deepcopy(base)
        ids = rank_ids(r)
        with torch.no_grad():
            zt = teacher(input_ids=ids).logits[:, :-1]
        zs = m(input_ids=ids).logits[:, :-1]
        loss = reference.logits(zs, zt, beta=0.0)
        loss.backward()
        for n, p in m.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / world
        if r == rank:
            loss_r = loss.detach()
    return loss_r, grads


def compare(model, loss, exp_loss, exp_grads, tol=1e-9):
    """A list of problems ([] when loss and every parameter's full gradient match)."""
    from torch.distributed.tensor import DTensor
    problems = []
    if not torch.allclose(loss.detach().to(DTYPE), exp_loss, rtol=tol, atol=tol):
        problems.append(f"loss {loss.item():.6g} != {exp_loss.item():.6g}")
    params = dict(model.named_parameters())
    for n, g in exp_grads.items():
        key = n if n in params else "module." + n
        p = params.get(key)
        if p is None:
            problems.append(f"{n}: no such parameter")
            continue
        grad = p.grad
        if grad is None:
            problems.append(f"{n}: grad None")
            continue
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        if grad.shape != g.shape:
            problems.append(f"{n}: grad shape {tuple(grad.shape)} vs {tuple(g.shape)}")
            continue
        err = (grad - g).abs().max().item()
        if err > tol * max(1.0, g.abs().max().item()) * 100:
            problems.append(f"{n}: grad max err {err:.3g}")
    return problems


def describe(t):
    from torch.distributed.tensor import DTensor
    if t is None:
        return "None"
    if isinstance(t, DTensor):
        return f"DTensor{tuple(t.shape)} local{tuple(t.to_local().shape)} {t.placements}"
    kind = "Parameter" if isinstance(t, torch.nn.Parameter) else "Tensor"
    try:
        storage = t.untyped_storage().size()
    except Exception:
        storage = "?"
    return f"{kind}{tuple(t.shape)} storage={storage}B"


def first_line(e):
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
