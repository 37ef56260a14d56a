"""Accelerate's fsdp2_prepare_model after the user has already fully_shard-ed lm_head (untied): the units it makes,
and how often the lm_head is all-gathered per step on the proposed path."""
import copy, torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import common as C, proto_hf as P
def main(rank, world):
    C.log_unshards()
    mesh = init_device_mesh("cpu", (world,))
    base, teacher = C.models("llama")
    exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
    s = copy.deepcopy(base)
    fully_shard(s.lm_head, mesh=mesh)
    s = C.accelerate_wrap(s, mesh)
    ids = C.rank_ids(rank)
    out = []
    for it in range(3):
        C.GROUPS.clear()
        loss = P.distillation_loss(s, teacher, ids); loss.backward()
        probs = C.compare(s, loss, exp_loss, exp_grads)
        out.append(("OK" if not probs else probs[:2], C.gathered(P.fsdp_sharded(s, s.lm_head))))
        for p in s.parameters(): p.grad = None
    if rank == 0:
        print("units:", [(u[0], u[2]) for u in C.fsdp_units(s)])
        print("per step (result, lm_head all-gathers):", out)
if __name__ == "__main__":
    C.run(main)
