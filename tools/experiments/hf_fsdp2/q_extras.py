"""Extras on the proposed sequence: gradient accumulation without sync, the training path, FSDP2 mixed precision,
the check failing on every rank together, tied-parameter identity, a pattern-(a) teacher's state after no_grad."""
import copy
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
import common as C
import proto_hf as P


def say(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def main(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    ids = C.rank_ids(rank)
    # 1. gradient accumulation: two micro-batches, FSDP's reduce-scatter skipped on the first
    for arch, pattern in (("llama", "b"), ("llama", "a"), ("qwen2", "bt"), ("qwen2", "c")):
        base, teacher = C.models(arch)
        exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
        s = C.wrap(copy.deepcopy(base), pattern, mesh)
        P._CHECKED.clear()
        for micro in range(2):
            s.set_requires_gradient_sync(micro == 1)
            loss = P.distillation_loss(s, teacher, ids)
            loss.backward()
        probs = C.compare(s, loss, exp_loss, {k: 2 * v for k, v in exp_grads.items()})
        say(rank, f"[accumulation] {arch} {pattern}: 2 micro-batches, sync on the last only:",
            "OK" if not probs else probs[:3])
    # 2. the training path (grad_in_forward=True) through FSDP2
    for arch, pattern in (("llama", "b"), ("qwen2", "bt"), ("gemma2", "a")):
        base, teacher = C.models(arch)
        exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
        s = C.wrap(copy.deepcopy(base), pattern, mesh)
        P._CHECKED.clear()
        loss = P.distillation_loss(s, teacher, ids, grad_in_forward=True)
        loss.backward()
        probs = C.compare(s, loss, exp_loss, exp_grads)
        say(rank, f"[grad_in_forward=True] {arch} {pattern}:", "OK" if not probs else probs[:3])
    # 3. FSDP2 mixed precision (bf16 params for compute, fp32 shards): the sharded fp32 weight cast to bf16
    base, teacher = C.models("llama")
    exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
    for pattern in ("b", "a"):
        s = copy.deepcopy(base).float()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in s.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        if pattern == "b":
            fully_shard(s.model, mesh=mesh, mp_policy=mp)
            fully_shard(s.lm_head, mesh=mesh, mp_policy=mp)
        fully_shard(s, mesh=mesh, mp_policy=mp)
        P._CHECKED.clear()
        try:
            loss = P.distillation_loss(s, teacher.float(), ids)
            loss.backward()
            rel = []
            for n, p in s.named_parameters():
                g, e = p.grad.full_tensor().double(), exp_grads[n]
                rel.append(((g - e).norm() / e.norm()).item())
            say(rank, f"[mixed precision bf16] llama {pattern}: loss {loss.item():.4f} vs {exp_loss.item():.4f}; "
                      f"grad dtype {s.lm_head.weight.grad.dtype}; worst relative grad error {max(rel):.3g}")
        except Exception as e:
            say(rank, f"[mixed precision bf16] llama {pattern}: ERROR", C.first_line(e))
    # 4. a wrong logit transform is caught, on every rank together (no rank left waiting in a collective)
    base, teacher = C.models("gemma2")
    s = C.wrap(copy.deepcopy(base), "bt", mesh)
    s.config.final_logit_softcapping = 2.0  # the model caps its logits at 2; nitrobrew is made to read no cap
    P._CHECKED.clear()
    original = P.hf._config_number
    P.hf._config_number = lambda config, *names: None if "final_logit_softcapping" in names else original(config, *names)
    try:
        P.check_against_own_logits(s, ids)
        say(rank, "[check] softcap unknown to nitrobrew: NOT caught")
    except ValueError as e:
        print(f"[check] rank {rank}: softcap unknown to nitrobrew caught: {e}", flush=True)
    finally:
        P.hf._config_number = original
    torch.distributed.barrier()
    # 5. tied parameters: one DTensor for both modules, in every pattern that accepts the tie
    base, teacher = C.models("qwen2")
    for pattern in ("a", "bt", "c"):
        s = C.wrap(copy.deepcopy(base), pattern, mesh)
        before = s.lm_head.weight is s.model.embed_tokens.weight
        s(input_ids=ids).logits.sum().backward()
        after = s.lm_head.weight is s.model.embed_tokens.weight
        same_sharded = P.fsdp_sharded(s, s.lm_head) is P.fsdp_sharded(s, s.model.embed_tokens)
        say(rank, f"[tied] qwen2 {pattern}: lm_head.weight is embed_tokens.weight before/after a step: "
                  f"{before}/{after}; one sharded DTensor for both: {same_sharded}; "
                  f"params listed once: {sum(1 for _ in s.parameters())} == {sum(1 for _ in base.parameters())}")
    # 6. a pattern-(a) teacher after a no_grad forward: its root group (embed, norm, lm_head) stays unsharded
    base, teacher = C.models("llama")
    t = C.wrap(copy.deepcopy(teacher), "a", mesh)
    with torch.no_grad():
        t(input_ids=ids)
    say(rank, "[teacher a] after a no_grad root forward: lm_head.weight", C.describe(t.lm_head.weight))
    t.reshard()
    say(rank, "[teacher a] after teacher.reshard():", C.describe(t.lm_head.weight))


if __name__ == "__main__":
    C.run(main)
