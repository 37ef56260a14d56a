"""Root fully_shard(model, reshard_after_forward=True) (pattern a, embed/norm/lm_head in the root group): does the
hidden state captured by a hook on the decoder (not a root output) still get the root's params re-gathered for
backward? Compared with the redirected paths."""
import copy
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import nitrobrew
import common as C


def main(rank, world, only):
    mesh = init_device_mesh("cpu", (world,))
    ids = C.rank_ids(rank)
    for arch in ("llama", "qwen2"):
        if rank == 0: print("start", arch, only, flush=True)
        base, teacher = C.models(arch)
        exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
        with torch.no_grad():
            ht = teacher.model(input_ids=ids).last_hidden_state[:, :-1]
        for method in (only,):
            m = copy.deepcopy(base)
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh, reshard_after_forward=True)
            res = []
            try:
                for it in range(2):
                    def loss_of(hs):
                        return nitrobrew.forward_kl(hs[:, :-1], ht, C.sharded_param(m, m.lm_head), teacher.lm_head.weight.detach())
                    if method == "redirect_loss":
                        loss = C.redirected(m, m, lambda i: loss_of(m.model(input_ids=i).last_hidden_state), ids)
                    else:
                        loss = loss_of(C.METHODS[method](m, ids))
                    loss.backward()
                    probs = C.compare(m, loss, exp_loss, exp_grads)
                    res.append("OK" if not probs else "WRONG " + "; ".join(probs[:3]))
                    for p in m.parameters():
                        p.grad = None
            except Exception as e:
                res.append("ERROR " + C.first_line(e))
            if rank == 0:
                print(f"{arch} root reshard_after_forward=True {method}: {res}", flush=True)
            torch.distributed.barrier()


if __name__ == "__main__":
    import sys
    C.run(main, sys.argv[1])
