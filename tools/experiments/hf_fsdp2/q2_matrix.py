"""Q2/Q3: every way to get the student's final hidden states x every way to read its lm_head weight, under
FSDP2 patterns, against the oracle (full logits of plain models, nitrobrew.reference.logits(beta=0), grads
averaged over ranks). Two iterations each (state left behind by the first must not spoil the second).
Also logs which FSDP groups all-gathered (unsharded) during each step."""
import copy
import itertools
import sys
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
import nitrobrew
import common as C


def step(m, teacher, ids, method, weight, rank):
    with torch.no_grad():
        ht = teacher.model(input_ids=ids).last_hidden_state[:, :-1]
    wt = teacher.get_output_embeddings().weight

    def loss_from(hs):
        if weight == "attr":
            ws = m.lm_head.weight
        else:
            ws = C.sharded_param(m, m.lm_head)
        info = C.describe(ws)
        return nitrobrew.forward_kl(hs[:, :-1], ht, ws, wt), info

    if method == "redirect_loss":
        box = {}

        def inner(i):
            hs = m.model(input_ids=i, use_cache=False).last_hidden_state
            loss, box["w"] = loss_from(hs)
            return loss
        loss = C.redirected(m, m, inner, ids)
        info = box["w"]
    else:
        hs = C.METHODS[method](m, ids)
        loss, info = loss_from(hs)
    loss.backward()
    return loss, info


def main(rank, world, only=None):
    C.log_unshards()
    mesh = init_device_mesh("cpu", (world,))
    ids = C.rank_ids(rank)
    methods = ("direct", "root_hs", "root_hs_last", "root_hook", "redirect", "redirect_loss")
    for arch, patterns in (("llama", ("a", "b", "b_head_only", "c")), ("qwen2", ("a", "bt", "c"))):
        base, teacher = C.models(arch)
        exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
        for pattern, method, weight, warm in itertools.product(patterns, methods, ("attr", "sharded"), (False, True)):
            if only and only not in f"{arch}/{pattern}/{method}/{weight}":
                continue
            tag = f"{arch:5s} {pattern:11s} {method:13s} w={weight:7s} warm={int(warm)}"
            m = C.wrap(copy.deepcopy(base), pattern, mesh)
            results = []
            try:
                if warm:
                    was = m.training
                    m.eval()
                    with torch.no_grad():
                        m(input_ids=ids[:1, :8])
                    m.train(was)
                for it in range(2):
                    C.UNSHARDS.clear()
                    loss, info = step(m, teacher, ids, method, weight, rank)
                    problems = C.compare(m, loss, exp_loss, exp_grads)
                    gathered = sorted(set(str(u) for u in C.UNSHARDS if u is not None and
                                          ("lm_head" in u or u == "" or "embed" in u)))
                    results.append(("OK" if not problems else "WRONG " + "; ".join(problems[:3]) +
                                    (f" (+{len(problems) - 3})" if len(problems) > 3 else "")) +
                                   f" | ws={info} | unsharded(head/root/embed groups)={gathered}")
                    for p in m.parameters():
                        p.grad = None
            except Exception as e:
                results.append("ERROR " + C.first_line(e))
            if rank == 0:
                for i, r in enumerate(results):
                    print(f"{tag} it{i}: {r}", flush=True)
            # an error may leave FSDP state mid-iteration; the model is thrown away
            torch.distributed.barrier()


if __name__ == "__main__":
    C.run(main, sys.argv[1] if len(sys.argv) > 1 else None)
