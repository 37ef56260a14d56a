"""The proposed call sequence (proto_hf.py) under DDP and FSDP2 students and teachers, against the oracle:
loss and every student parameter's gradient; counts all-gathers that included either lm_head weight."""
import copy
import itertools
import sys
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
import common as C
import proto_hf as P


def wrap_student(base, how, mesh):
    m = copy.deepcopy(base)
    if how == "ddp":
        return DDP(m)
    if how == "plain":
        return m
    return C.wrap(m, how, mesh)


def wrap_teacher(teacher, how, mesh):
    t = copy.deepcopy(teacher)
    if how == "plain":
        return t
    if how == "trl_root":  # trl.models.utils.prepare_fsdp: fully_shard(model) alone
        fully_shard(t, mesh=mesh, reshard_after_forward=True)
        return t
    return C.wrap(t, how, mesh)


def main(rank, world, only=None, use_method=False):
    P.USE_METHOD = use_method
    C.log_unshards()
    mesh = init_device_mesh("cpu", (world,))
    ids = C.rank_ids(rank)
    for arch in ("llama", "qwen2", "gemma2"):
        base, teacher = C.models(arch)
        exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
        b = "b" if arch == "llama" else "bt"
        for s_how, t_how in itertools.product(("ddp", "a", b, "c"), ("plain", "trl_root", b)):
            tag = f"{arch:6s} student={s_how:4s} teacher={t_how:8s}"
            if only and only not in tag:
                continue
            P._CHECKED.clear()
            s, t = wrap_student(base, s_how, mesh), wrap_teacher(teacher, t_how, mesh)
            res = []
            try:
                for it in range(3):
                    C.GROUPS.clear()
                    loss = P.distillation_loss(s, t, ids)
                    loss.backward()
                    probs = C.compare(s, loss, exp_loss, exp_grads)
                    sw = P.fsdp_sharded(P.split(s)[1], P.split(s)[1].get_output_embeddings())
                    tw = P.fsdp_sharded(t, t.get_output_embeddings())
                    ag = f"lm_head all-gathers: student {C.gathered(sw) if sw is not None else '-'}, " \
                         f"teacher {C.gathered(tw) if tw is not None else '-'}"
                    res.append(("OK" if not probs else "WRONG " + "; ".join(probs[:3])) + " | " + ag)
                    for p in s.parameters():
                        p.grad = None
            except Exception as e:
                import traceback
                res.append("ERROR " + C.first_line(e) + "\n" + "".join(traceback.format_exc().splitlines(True)[-6:]))
            if rank == 0:
                print(f"{tag}: " + " || ".join(f"it{i}({'check+' if i == 0 else ''}step) {r}" for i, r in enumerate(res)),
                      flush=True)
            torch.distributed.barrier()


if __name__ == "__main__":
    C.run(main, (sys.argv[1] or None) if len(sys.argv) > 1 else None, len(sys.argv) > 2 and sys.argv[2] == 'method')
