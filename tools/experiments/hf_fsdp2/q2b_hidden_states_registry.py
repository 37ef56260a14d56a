"""Why output_hidden_states=True returns hidden_states=None when model.model is its own fully_shard unit:
transformers 5.x keys _can_record_outputs by str(model.__class__); fully_shard swaps the class to FSDP<Name>."""
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import common as C
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY


def main(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    m, _ = C.models("llama")
    ids = C.rank_ids(rank)
    out = m(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
    if rank == 0:
        print("plain: hidden_states", len(out.hidden_states), "last == normed last_hidden_state:",
              torch.equal(out.hidden_states[-1], m.model(input_ids=ids).last_hidden_state))
        out = m(input_ids=ids, output_hidden_states=-1, logits_to_keep=1)
        print("plain output_hidden_states=-1:", [None if h is None else tuple(h.shape) for h in out.hidden_states])
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m.model, mesh=mesh)
    fully_shard(m, mesh=mesh)
    out = m(input_ids=ids, output_hidden_states=True, logits_to_keep=1)
    if rank == 0:
        print("model.model class now:", type(m.model).__name__, "| registry has it:",
              bool(_CAN_RECORD_REGISTRY.get(m.model)), "| out.hidden_states:", out.hidden_states)


if __name__ == "__main__":
    C.run(main)
