"""Q1: what happens when model.model(...) is called directly (bypassing the root's forward) under FSDP2
wrapping patterns a / b / bt / c, cold (first forward ever) and warm (after a root forward + backward);
types of lm_head.weight / embed_tokens.weight around the root's forward."""
import copy
import torch
from torch.distributed.device_mesh import init_device_mesh
import common as C


def say(rank, *a):
    if rank == 0:
        print(*a, flush=True)


def main(rank, world):
    mesh = init_device_mesh("cpu", (world,))
    ids = C.rank_ids(rank)
    for arch, patterns in (("llama", ("a", "b", "c")), ("qwen2", ("a", "b", "bt", "c"))):
        base, teacher = C.models(arch)
        for pattern in patterns:
            tag = f"[{arch} tied={C.tied(base)} pattern={pattern}]"
            try:
                m = C.wrap(copy.deepcopy(base), pattern, mesh)
            except Exception as e:
                say(rank, tag, "wrap error:", C.first_line(e)); continue
            say(rank, tag, "before fwd: lm_head.weight", C.describe(m.lm_head.weight), "| is embed:",
                m.lm_head.weight is m.model.embed_tokens.weight)
            # cold: decoder first
            try:
                hs = m.model(input_ids=ids, use_cache=False).last_hidden_state
                say(rank, tag, "COLD direct model.model(): ok, hs", tuple(hs.shape), "lm_head.weight now",
                    C.describe(m.lm_head.weight))
                try:
                    (hs.float() ** 2).mean().backward()
                    say(rank, tag, "COLD direct backward ok; layers.0 q grad", C.describe(m.model.layers[0].self_attn.q_proj.weight.grad),
                        "embed grad", C.describe(m.model.embed_tokens.weight.grad))
                except Exception as e:
                    say(rank, tag, "COLD direct backward error:", C.first_line(e))
                try:
                    m(input_ids=ids)
                    say(rank, tag, "COLD then root forward: ok")
                except Exception as e:
                    say(rank, tag, "COLD then root forward error:", C.first_line(e))
            except Exception as e:
                say(rank, tag, "COLD direct model.model() error:", C.first_line(e))
            # warm: root forward + backward first
            m = C.wrap(copy.deepcopy(base), pattern, mesh)
            try:
                out = m(input_ids=ids)
            except Exception as e:
                say(rank, tag, "WARM root forward error:", C.first_line(e)); continue
            say(rank, tag, "units (after lazy init):", C.fsdp_units(m))
            say(rank, tag, "after root fwd: lm_head.weight", C.describe(m.lm_head.weight), "| embed",
                C.describe(m.model.embed_tokens.weight), "| norm", C.describe(m.model.norm.weight),
                "| same obj:", m.lm_head.weight is m.model.embed_tokens.weight)
            out.logits.float().pow(2).mean().backward()
            say(rank, tag, "after root bwd: lm_head.weight", C.describe(m.lm_head.weight), "| embed",
                C.describe(m.model.embed_tokens.weight), "| norm", C.describe(m.model.norm.weight))
            seen = {}

            def pre(mod, args, kwargs, seen=seen):
                seen["embed_w"] = C.describe(mod.weight)
            hk = m.model.embed_tokens.register_forward_pre_hook(pre, with_kwargs=True)
            try:
                hs = m.model(input_ids=ids, use_cache=False).last_hidden_state
                say(rank, tag, "WARM direct model.model(): ok; embed weight seen inside:", seen.get("embed_w"),
                    "| lm_head.weight after:", C.describe(m.lm_head.weight))
                try:
                    (hs.float() ** 2).mean().backward()
                    say(rank, tag, "WARM direct backward ok; embed grad", C.describe(m.model.embed_tokens.weight.grad),
                        "| lm_head.weight after bwd", C.describe(m.lm_head.weight))
                except Exception as e:
                    say(rank, tag, "WARM direct backward error:", C.first_line(e))
            except Exception as e:
                say(rank, tag, "WARM direct model.model() error:", C.first_line(e), "| embed weight seen:",
                    seen.get("embed_w"))
            finally:
                hk.remove()
            torch.distributed.barrier()


if __name__ == "__main__":
    C.run(main)
