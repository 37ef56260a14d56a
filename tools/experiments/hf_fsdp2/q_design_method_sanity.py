import copy, torch
from torch.distributed.device_mesh import init_device_mesh
import common as C, proto_hf as P
def main(rank, world):
    P.USE_METHOD = True
    mesh = init_device_mesh("cpu", (world,))
    base, teacher = C.models("llama")
    s = C.wrap(copy.deepcopy(base), "b", mesh)
    P.distillation_loss(s, teacher, C.rank_ids(rank)).backward()
    if rank == 0: print("method path used:", getattr(s, "_nitrobrew_registered", False), "| forward patched during call? no: forward is", s.forward.__func__.__qualname__)
if __name__ == "__main__":
    C.run(main)
