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


def unwrapped(model):
    """The transformers model under DistributedDataParallel's, torch.compile's and PEFT's wrappers (FSDP2 does
    not wrap: a fully_shard-ed model is the model, its class swapped)."""
    if is_ddp(model):
        model = model.module
    model = getattr(model, "_orig_mod", model)  # torch.compile
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    return get_base() if callable(get_base) else model


def split(model):
    """(the module to call, the transformers model inside): (ddp, its model) for DDP, else (model, model), under
    torch.compile's and PEFT's wrappers. Raises for layouts nitrobrew.hf cannot run."""
    wrapper = model
    inner = unwrapped(model)
    if not is_ddp(model) and not is_fsdp(inner) and _fsdp_module_class() is not None and any(
            is_fsdp(m) for m in inner.modules()):
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
    if is_fsdp(inner) and wrapper is inner:
        if "_nitrobrew_run" not in vars(inner):
            try:
                from torch.distributed.fsdp import register_fsdp_forward_method
            except ImportError:  # torch < 2.6
                from torch.distributed._composable.fsdp import register_fsdp_forward_method
            inner._nitrobrew_run = types.MethodType(_run, inner)
            register_fsdp_forward_method(inner, "_nitrobrew_run")
        return inner._nitrobrew_run(fn, *args, **kwargs)
    if is_ddp(wrapper):
        module = wrapper.module
        original = module.forward

        def forward(*a, **k):
            module.forward = original
            return fn(*a, **k)

        module.forward = forward
        try:
            return wrapper(*args, **kwargs)
        finally:
            module.forward = original
    return fn(*args, **kwargs)


def managed_param(inner, module, name: str):
    """The parameter `module.<name>` as FSDP2 keeps it between forwards (its Shard(0) DTensor, also while an
    unsharded copy is registered), or what the module holds for a model FSDP2 does not manage."""
    current = getattr(module, name, None)
    if not is_fsdp(inner):
        return current
    for m in inner.modules():
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
    """The group whose ranks check a model together (each its own rows or tokens), or None for a plain model."""
    if _is_dtensor(weight):
        return weight.device_mesh.get_group()
    if is_ddp(wrapper):
        return wrapper.process_group
    return None
