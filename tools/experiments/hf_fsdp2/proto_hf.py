"""A prototype of the proposed nitrobrew.hf call sequence under DDP / FSDP2 (not nitrobrew's code)."""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
import nitrobrew
from nitrobrew import hf


def split(model):
    """(wrapper to call, the transformers model inside): DDP -> (ddp, ddp.module); FSDP2 / plain -> (m, m)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return model, hf._unwrapped(inner)


def redirected(wrapper, inner, fn, *args, **kwargs):
    """fn(*args, **kwargs) run as `inner`'s forward, called through `wrapper` so DDP's forward / FSDP2's root hooks
    run around it (TRL's _ForwardRedirection)."""
    original = inner.forward

    def forward(*a, **k):
        inner.forward = original
        return fn(*a, **k)
    inner.forward = forward
    try:
        return wrapper(*args, **kwargs)
    finally:
        inner.forward = original


def fsdp_sharded(model, module, name="weight"):
    """The sharded DTensor parameter FSDP2 manages as module.<name>, whatever is registered right now."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    info = fp._module_info
                    owners = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]
                    if any(o is module and n == name for o, n in owners):
                        return fp.sharded_param
    return None


def head_weight(inner):
    head = inner.get_output_embeddings()
    w = fsdp_sharded(inner, head)
    return head.weight if w is None else w


def decoder_hidden(inner, input_ids, attention_mask):
    out = hf._decoder(inner)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


_CHECKED = set()


def check_against_own_logits(model, input_ids):
    """The model's own logits (one forward through its wrapper: FSDP2 all-gathers as it always does) against
    h @ W.T on this rank's rows of W (no weight gathered by nitrobrew); the worst error is all-reduced (MAX) so
    every rank raises together."""
    wrapper, inner = split(model)
    if id(inner) in _CHECKED:
        return
    probe = input_ids[:1, : min(input_ids.shape[1], 8)]
    box = {}
    hook = hf._decoder(inner).register_forward_hook(
        lambda m, a, o: box.__setitem__("h", o.last_hidden_state if hasattr(o, "last_hidden_state") else o[0]))
    training = {m: m.training for m in inner.modules()}
    inner.eval()
    try:
        with torch.no_grad():
            own = wrapper(input_ids=probe, use_cache=False).logits.float()
    finally:
        hook.remove()
        for m, flag in training.items():
            m.training = flag
    w = head_weight(inner)
    config = hf._text_config(inner.config)
    softcap = hf._config_number(config, "final_logit_softcapping")
    rows = w
    if isinstance(w, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        rows = w.to_local()
        (n, _), (offset, _) = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        own = own[..., offset:offset + n]
    z = box["h"].float() @ rows.detach().float().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    err = (z - own).abs().max() if own.numel() else torch.zeros(())
    if dist.is_initialized() and (isinstance(w, DTensor) or wrapper is not inner):
        group = w.device_mesh.get_group() if isinstance(w, DTensor) else None
        dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
    if not err.item() <= 2e-2 * max(1.0, own.abs().max().item() if own.numel() else 1.0):
        raise ValueError(f"{type(inner).__name__}: logits differ from h @ lm_head.T by {err.item():.3g}")
    _CHECKED.add(id(inner))


def distillation_loss(student, teacher, input_ids, attention_mask=None, check=True, **options):
    s_wrap, s_inner = split(student)
    t_wrap, t_inner = split(teacher)
    if check:
        check_against_own_logits(student, input_ids)
        check_against_own_logits(teacher, input_ids)
    softcap_s = hf._config_number(hf._text_config(s_inner.config), "final_logit_softcapping")
    softcap_t = hf._config_number(hf._text_config(t_inner.config), "final_logit_softcapping")
    with torch.no_grad():  # the teacher first, through its own wrapper
        h_t = redirected(t_wrap, t_inner, decoder_hidden, t_inner, input_ids, attention_mask)[:, :-1]
        w_t = head_weight(t_inner).detach()

    def student_loss(input_ids, attention_mask):  # runs as the student's forward, inside its wrapper
        h_s = decoder_hidden(s_inner, input_ids, attention_mask)[:, :-1]
        w_s, wt = head_weight(s_inner), w_t
        if isinstance(wt, DTensor) and not isinstance(w_s, DTensor):
            wt = wt.full_tensor()  # DDP / plain student, sharded teacher: the teacher's weight is gathered
        if isinstance(w_s, DTensor) and w_s.dtype != h_s.dtype:
            w_s = w_s.to(h_s.dtype)  # FSDP2 mixed precision: fp32 shards, 16-bit activations
        return nitrobrew.forward_kl(h_s, h_t.to(h_s.dtype), w_s, wt.to(h_s.dtype), softcap_s=softcap_s,
                                    softcap_t=softcap_t, **options)
    return redirected(s_wrap, s_inner, student_loss, input_ids, attention_mask)


# Variant: FSDP2's public register_fsdp_forward_method instead of patching forward (DDP still redirected).
import types as _types


def _run(self, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def through_wrapper(wrapper, inner, fn, *args):
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    if isinstance(inner, FSDPModule) and wrapper is inner:
        if not getattr(inner, "_nitrobrew_registered", False):
            inner._nitrobrew_run = _types.MethodType(_run, inner)
            register_fsdp_forward_method(inner, "_nitrobrew_run")
            inner._nitrobrew_registered = True
        return inner._nitrobrew_run(fn, *args)
    return redirected(wrapper, inner, fn, *args)


USE_METHOD = False
_redirected_patch = redirected


def redirected(wrapper, inner, fn, *args, **kwargs):  # noqa: F811
    if USE_METHOD:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
        if isinstance(inner, FSDPModule) and wrapper is inner:
            if not getattr(inner, "_nitrobrew_registered", False):
                inner._nitrobrew_run = _types.MethodType(_run, inner)
                register_fsdp_forward_method(inner, "_nitrobrew_run")
                inner._nitrobrew_registered = True
            return inner._nitrobrew_run(fn, *args, **kwargs)
    return _redirected_patch(wrapper, inner, fn, *args, **kwargs)
