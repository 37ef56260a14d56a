"""Where a profiled region leaves the GPU idle: from a torch.profiler run's trace, the span from the
first kernel's start to the last one's end, the kernels' summed time, and the largest gaps between
consecutive kernels (with the kernels on either side). With timeline=True, also every device op in
order, its start counted from the start of the host's `record_function("step")` region when the
trace has one (the time the GPU waits for the host's first launch). Used by the profile_* tools."""

import json
import os
import tempfile

DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def print_gaps(prof, top=8, timeline=False):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    ops = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    if not ops:
        print("no device events in the trace")
        return
    busy = sum(e["dur"] for e in ops)
    span = ops[-1]["ts"] + ops[-1]["dur"] - ops[0]["ts"]
    gaps = []
    end = ops[0]["ts"] + ops[0]["dur"]
    for prev, e in zip(ops, ops[1:]):
        gap = e["ts"] - end
        if gap > 0:
            gaps.append((gap, prev["name"][:60], e["name"][:60]))
        end = max(end, e["ts"] + e["dur"])
    idle = sum(g for g, _, _ in gaps)
    if timeline:
        steps = [e for e in events if e.get("cat") == "user_annotation" and e.get("name") == "step"]
        origin = steps[0]["ts"] if steps else ops[0]["ts"]
        print("device ops (start and duration in ms, from the start of the host's step region):")
        for e in ops:
            print(f"  {(e['ts'] - origin) / 1e3:8.3f} {e['dur'] / 1e3:8.3f}  {e['name'][:90]}")
    print(f"device timeline: {len(ops)} ops, span {span / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms, "
          f"idle {idle / 1e3:.3f} ms in {len(gaps)} gaps")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap / 1e3:8.3f} ms idle after {before} before {after}")
