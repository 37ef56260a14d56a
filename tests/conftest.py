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
