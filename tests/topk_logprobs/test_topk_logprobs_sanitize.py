"""Runs the CUDA kernel of nitrobrew.topk_logprobs once on small, awkward problems, for compute-sanitizer
(memcheck, racecheck): rows that select their candidates several times, k at its maximum, a vocabulary that
is no multiple of a round, padding, a bias, and undefined rows; the row kernel's path and the walk's.

    compute-sanitizer --tool racecheck python -m pytest -m sanitize tests/topk_logprobs
"""

import math

import pytest
import torch

import nitrobrew
from conftest import CUDA, DEV_BUILD

pytestmark = [CUDA, pytest.mark.sanitize]


# The op's path for the inputs, and in a development build its walk forced: lists that hold every row's k best,
# and lists too short for many rows, which the row kernel redoes.
PATHS = [None] + [pytest.param(setting, marks=DEV_BUILD) for setting in ("1024:12288", "16:40")]


@pytest.mark.parametrize("walk", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_once(dtype, walk, monkeypatch):
    if walk is not None:
        monkeypatch.setenv("NITROBREW_TOPK_LOGPROBS_WALK", walk)
    g = torch.Generator(device="cuda").manual_seed(0)
    for n, v, d, k in [(5, 9001, 16, 1024), (37, 3000, 8, 7), (3, 1, 4, 1)]:
        x = torch.randn(n, d, device="cuda", generator=g).to(dtype)
        w = torch.randn(v + 5, d, device="cuda", generator=g).to(dtype)  # 5 padding rows
        bias = torch.randn(v + 5, device="cuda", generator=g).to(dtype)
        if n > 3:
            x[1, 0] = math.nan  # an undefined row
            bias[: v // 2] = -math.inf  # entries of probability 0
        lp, ids, lse, ent = nitrobrew.topk_logprobs(x, w, k, bias=bias, vocab_size=v, temperature=0.5,
                                                    return_stats=True)
        torch.cuda.synchronize()
        assert ((ids >= 0) & (ids < v)).all() and lp.shape == (n, k)
        if n > 3:
            assert lp[1].isnan().all() and lp[0].isfinite().any()
