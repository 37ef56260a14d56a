"""An FSDP2 teacher run only under no_grad: does FSDP's post_forward_order (cleared in the root's post-backward
callback) grow step after step?"""
import copy, torch
from torch.distributed.device_mesh import init_device_mesh
import common as C
def main(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    _, teacher = C.models("llama")
    t = C.wrap(copy.deepcopy(teacher), "b", mesh)
    lens = []
    for step in range(4):
        with torch.no_grad():
            t(input_ids=C.rank_ids(rank))
        lens.append(len(t._get_fsdp_state()._comm_ctx.post_forward_order))
    if rank == 0:
        print("teacher (pattern b) len(post_forward_order) after each no_grad forward:", lens)
if __name__ == "__main__":
    C.run(main)
