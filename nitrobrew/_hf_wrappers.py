"""How nitrobrew.hf runs models that DistributedDataParallel or FSDP2 (fully_shard) wrap
(docs/notes/hf_distributed.md has the experiments behind each rule):

- a model's decoder runs *inside its wrapper's forward*: FSDP2 gathers and reshards its parameters as in any
  step, and DDP sees the loss as its forward's output, so that it synchronizes the gradients. Calling the
  decoder alone fails or breaks the model under FSDP2 and silently skips DDP's gradient synchronization;
- the lm_head weight is the DTensor shard FSDP2 manages (whatever is registered on the module at the moment),
  so that nitrobrew's DTensor path computes the loss without gathering any weight.

torch.distributed is imported only for models that use it.
"""

from __future__ import annotations

import sys
import types

import torch

_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def _fsdp_module_class():
    """FSDP2's FSDPModule, or None where no fully_shard-ed module can exist (FSDP2 not imported)."""
    for name in _FSDP_MODULES:
        module = sys.modules.get(name)
        cls = getattr(module, "FSDPModule", None) if module is not None else None
        if cls is not None:
            return cls
    return None


def is_fsdp(module) -> bool:
    cls = _fsdp_module_class()
    return cls is not None and isinstance(module, cls)


def is_ddp(model) -> bool:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def chain(model) -> list:
    """The model and the wrappers around it, outermost first: DistributedDataParallel, torch.compile's
    OptimizedModule and PEFT's PeftModel, in any order and nesting (accelerate compiles, then shards or wraps in
    DDP; TRL shards a PeftModel). FSDP2 does not wrap: a fully_shard-ed module is itself, its class swapped."""
    modules = [model]
    while True:
        m = modules[-1]
        if is_ddp(m):
            nxt = m.module
        elif isinstance(getattr(m, "_orig_mod", None), torch.nn.Module):  # torch.compile
            nxt = m._orig_mod
        elif callable(getattr(m, "get_base_model", None)):  # peft.PeftModel
            nxt = m.get_base_model()
        else:
            return modules
        if nxt is m:
            return modules
        modules.append(nxt)


def unwrapped(model):
    """The transformers model under every wrapper of `chain`."""
    return chain(model)[-1]


def sharded(model) -> bool:
    """Whether FSDP2 manages any module of the model (its wrappers included)."""
    return _fsdp_module_class() is not None and any(is_fsdp(m) for m in model.modules())


def split(model):
    """(the module whose forward nitrobrew.hf runs through, the transformers model inside): the outermost DDP
    module or FSDP2 root of the model's wrapper chain, else the model itself. Raises for layouts nitrobrew.hf
    cannot run."""
    modules = chain(model)
    inner = modules[-1]
    wrapper = next((m for m in modules if is_ddp(m) or is_fsdp(m)), inner)
    if not is_ddp(wrapper) and not is_fsdp(wrapper) and sharded(inner):
        raise ValueError(f"{type(inner).__name__} has fully_shard-ed submodules but is not fully_shard-ed itself: "
                         f"nitrobrew.hf runs the decoder inside the root's forward, so shard the root too "
                         f"(fully_shard(model) after its layers, as accelerate does)")
    return wrapper, inner


def _run(self, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def run_through(wrapper, inner, fn, *args, **kwargs):
    """fn(*args, **kwargs) run as the wrapper's forward: under FSDP2 as a registered forward method of the root
    (its parameters gathered before, resharded after, as in a forward), under DDP as the DDP module's forward (the
    module's forward swapped for fn during one call of the wrapper), else a plain call."""
    if is_fsdp(wrapper):
        if "_nitrobrew_run" not in vars(wrapper):
            try:
                from torch.distributed.fsdp import register_fsdp_forward_method
            except ImportError:  # torch < 2.6
                from torch.distributed._composable.fsdp import register_fsdp_forward_method
            wrapper._nitrobrew_run = types.MethodType(_run, wrapper)
            register_fsdp_forward_method(wrapper, "_nitrobrew_run")
        return wrapper._nitrobrew_run(fn, *args, **kwargs)
    if is_ddp(wrapper):
        module = wrapper.module
        had_own = "forward" in vars(module)  # accelerate's mixed precision sets one
        original = module.forward

        def restore():
            if had_own:
                module.forward = original
            else:
                vars(module).pop("forward", None)

        def forward(*a, **k):
            restore()
            return fn(*a, **k)

        module.forward = forward
        try:
            return wrapper(*args, **kwargs)
        finally:
            restore()
    return fn(*args, **kwargs)


def managed_param(model, module, name: str):
    """The parameter `module.<name>` as FSDP2 keeps it between forwards (its Shard(0) DTensor, also while an
    unsharded copy is registered), or what the module holds for a model FSDP2 does not manage. `model`: the
    model as passed, its wrappers included (the FSDP2 root may be one of them)."""
    current = getattr(module, name, None)
    if not sharded(model):
        return current
    for m in model.modules():
        if not is_fsdp(m):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.6: one group a state
            group = getattr(state, "_fsdp_param_group", None)
            groups = [] if group is None else [group]
        for group in groups:
            for param in group.fsdp_params:
                info = param._module_info
                owners = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]
                if any(owner is module and owner_name == name for owner, owner_name in owners):
                    return param.sharded_param
    if current is not None and _is_dtensor(current):
        raise RuntimeError(f"nitrobrew.hf could not find the FSDP2 shard of {type(module).__name__}.{name} in this "
                           f"torch ({torch.__version__}): FSDP2's internals changed. Please report it")
    return current  # not managed by FSDP2 (ignored_params), or a parameter FSDP2 left on the module


def _is_dtensor(t) -> bool:
    from nitrobrew import distributed

    return distributed.is_dtensor(t)


def check_group(wrapper, weight):
    """The group whose ranks check a model together (each its own rows or tokens), or None for a plain model:
    a sharded lm_head's mesh (every rank, for the 2-D meshes of HSDP), or DDP's group."""
    if _is_dtensor(weight):
        mesh = weight.device_mesh
        if mesh.ndim == 1:
            return mesh.get_group()
        import torch.distributed as dist

        return dist.group.WORLD
    if is_ddp(wrapper):
        return wrapper.process_group
    return None
