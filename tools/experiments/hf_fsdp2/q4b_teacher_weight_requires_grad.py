import copy, traceback, torch
from torch.distributed.device_mesh import init_device_mesh
import nitrobrew, common as C
def main(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    base, teacher = C.models("llama")
    t = C.wrap(copy.deepcopy(teacher), "b", mesh)
    w = t.lm_head.weight.full_tensor()
    print(rank, type(w), w.requires_grad, type(w).__mro__[:2])
    try:
        hs = torch.randn(5, 32, dtype=torch.float64, requires_grad=True)
        nitrobrew.forward_kl(hs, torch.randn(5, 32, dtype=torch.float64), base.lm_head.weight, w).backward()
        print("ok")
    except Exception:
        traceback.print_exc()
    with torch.no_grad():
        w2 = t.lm_head.weight.full_tensor()
    nitrobrew.forward_kl(hs, torch.randn(5, 32, dtype=torch.float64), base.lm_head.weight, w2).backward(); print("ok no_grad full_tensor")
if __name__ == "__main__":
    C.run(main)
