"""Q4: a DDP student (teacher plain, then FSDP2-sharded): which call paths keep DDP's gradient sync."""
import copy
import itertools
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.device_mesh import init_device_mesh
import nitrobrew
import common as C


def run_case(ddp, teacher, ids, method, wt_fn=None):
    inner = ddp.module
    with torch.no_grad():
        ht = teacher.model(input_ids=ids).last_hidden_state[:, :-1]
    with torch.no_grad():  # the teacher's weight enters the loss without autograd
        wt = (wt_fn or (lambda: teacher.lm_head.weight))()

    def loss_of(hs):
        return nitrobrew.forward_kl(hs[:, :-1], ht, inner.lm_head.weight, wt)
    if method == "direct":
        loss = loss_of(inner.model(input_ids=ids, use_cache=False).last_hidden_state)
    elif method == "root_hook":
        box = {}
        h = inner.model.register_forward_hook(lambda m, a, o: box.__setitem__("h", o.last_hidden_state))
        ddp(input_ids=ids, use_cache=False, logits_to_keep=1)
        h.remove()
        loss = loss_of(box["h"])
    elif method == "redirect":
        hs = C.redirected(ddp, inner, lambda i: inner.model(input_ids=i, use_cache=False).last_hidden_state, ids)
        loss = loss_of(hs)
    elif method == "redirect_loss":
        loss = C.redirected(ddp, inner, lambda i: loss_of(inner.model(input_ids=i, use_cache=False).last_hidden_state), ids)
    loss.backward()
    return loss


def main(rank, world):
    ids = C.rank_ids(rank)
    for arch in ("llama", "qwen2"):
        base, teacher = C.models(arch)
        exp_loss, exp_grads = C.oracle(base, teacher, world, rank)
        for method, unused in itertools.product(("direct", "root_hook", "redirect", "redirect_loss"), (False, True)):
            tag = f"{arch:5s} DDP(find_unused_parameters={unused!s:5s}) {method:13s}"
            ddp = DDP(copy.deepcopy(base), find_unused_parameters=unused)
            res = []
            try:
                for it in range(2):
                    loss = run_case(ddp, teacher, ids, method)
                    probs = C.compare(ddp, loss, exp_loss, exp_grads)
                    res.append("OK" if not probs else "WRONG " + "; ".join(probs[:3]) + f" ({len(probs)} params)")
                    ddp.zero_grad(set_to_none=True)
            except Exception as e:
                res.append("ERROR " + C.first_line(e))
                err_text = " ".join(str(e).split())[:1500]
            if rank == 0:
                for i, r in enumerate(res):
                    print(f"{tag} it{i}: {r}", flush=True)
                    if "mark a variable ready only once" in r and arch == "llama":
                        print("   full message:", err_text)
            torch.distributed.barrier()
        # DDP student, FSDP2 teacher (lm_head its own unit)
        mesh = init_device_mesh("cpu", (world,))
        t = C.wrap(copy.deepcopy(teacher), "b" if arch == "llama" else "bt", mesh)
        for how in ("dtensor", "full_tensor"):
            ddp = DDP(copy.deepcopy(base))
            try:
                def wt_fn():
                    return t.lm_head.weight if how == "dtensor" else t.lm_head.weight.full_tensor()
                with torch.no_grad():  # teacher's hidden states through its root's hooks
                    pass
                loss = run_case(ddp, teacher, ids, "redirect_loss", wt_fn)
                probs = C.compare(ddp, loss, exp_loss, exp_grads)
                r = "OK" if not probs else "WRONG " + "; ".join(probs[:3])
            except Exception as e:
                r = "ERROR " + C.first_line(e)
            if rank == 0:
                print(f"{arch:5s} DDP student + FSDP2 teacher lm_head ({how}): {r}", flush=True)
            torch.distributed.barrier()


if __name__ == "__main__":
    C.run(main)
