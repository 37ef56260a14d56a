import os

import pytest
import torch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# Tests of the switches that only a development build compiles in (NITROBREW_DEV_KNOBS=1 at build
# time; the GPU runner sets it for the build and the tests alike).
DEV_BUILD = pytest.mark.skipif(os.environ.get("NITROBREW_DEV_KNOBS") != "1",
                               reason="needs a development build (NITROBREW_DEV_KNOBS=1)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_terminal_summary(terminalreporter):
    """One line of what was skipped and why, most common first (no GPU, no NCCL, a missing extra, ...)."""
    reasons = {}
    for report in terminalreporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):
            reason = report.longrepr[2].removeprefix("Skipped: ")
            reasons[reason] = reasons.get(reason, 0) + 1
    if reasons:
        ranked = sorted(reasons.items(), key=lambda item: -item[1])
        shown = "; ".join(f"{count} {reason}" for reason, count in ranked[:6])
        more = f"; {len(ranked) - 6} other reasons" if len(ranked) > 6 else ""
        terminalreporter.write_line(f"skipped {sum(reasons.values())}: {shown}{more}")
