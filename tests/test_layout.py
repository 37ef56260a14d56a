"""The source layout's rules, which the compiler does not check: the engine knows no loss, and the
build's sources and operators are complete and unambiguous."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import nitrobrew  # noqa: F401  (registers the operators)

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
FAMILIES = ("fused_linear", "topk_linear", "logits", "attention_kl", "topk_logprobs")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _build_module():
    spec = importlib.util.spec_from_file_location("nitrobrew_build", ROOT / "nitrobrew" / "_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _includes(path: Path) -> list[Path]:
    return [(path.parent / name).resolve() for name in INCLUDE.findall(path.read_text())]


def _closure(start: Path) -> set[Path]:
    seen, todo = set(), [start]
    while todo:
        path = todo.pop()
        for inc in _includes(path):
            if inc not in seen:
                seen.add(inc)
                todo.append(inc)
    return seen


def test_every_project_include_resolves():
    for path in CSRC.rglob("*"):
        if path.suffix in (".h", ".cuh", ".cpp", ".cu"):
            for inc in _includes(path):
                assert inc.is_file(), f"{path.relative_to(ROOT)} includes {inc} which does not exist"


def test_the_engine_includes_nothing_of_a_loss():
    # csrc/engine/ walks tiles of matrix products and folds them with passes it is given: what it
    # includes, directly or not, stays inside it.
    engine = CSRC / "engine"
    for path in engine.rglob("*"):
        if path.suffix in (".h", ".cuh", ".cpp", ".cu"):
            outside = sorted(str(p.relative_to(CSRC)) for p in _closure(path) if engine not in p.parents)
            assert not outside, f"{path.relative_to(ROOT)} reaches {outside}"


def test_the_divergence_math_includes_no_family():
    for path in (CSRC / "divergence").glob("*"):
        reached = {p.relative_to(CSRC).parts[0] for p in _closure(path)}
        assert not reached & set(FAMILIES), f"{path.relative_to(ROOT)} reaches {sorted(reached & set(FAMILIES))}"


def test_sources_are_split_between_the_builds_and_named_uniquely():
    build = _build_module()
    cpp, cuda = build.cpp_sources(str(ROOT)), build.cuda_sources(str(ROOT))
    assert cpp and cuda and not set(cpp) & set(cuda)
    assert all(p.endswith(".cpp") and not p.endswith("_cuda.cpp") for p in cpp)
    assert all(p.endswith(".cu") or p.endswith("_cuda.cpp") for p in cuda)
    # torch.utils.cpp_extension.load (NITROBREW_JIT=1) names each object after its file's base name.
    stems = [Path(p).stem for p in cpp + cuda]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)


def _schema_names() -> list[str]:
    text = (CSRC / "registration.cpp").read_text()
    return re.findall(r'"(\w+)\(', text)


def test_every_op_has_a_cpu_kernel_a_fake_and_autograd():
    names = _schema_names()
    assert len(names) == 21 and {n[:-4] for n in names if n.endswith("_fwd")} == {
        "fused_linear", "topk_linear", "logits", "topk_logits", "attention_kl"}
    # The vocabulary shards' forward-only ops (nitrobrew.distributed differentiates around them) and the
    # training path's chunk step, products, stages over a shard's products, float32 dws accumulation and
    # gradient scaling (nitrobrew._forward_grads differentiates around them); the teacher's top-K, which has
    # no gradient.
    assert set(names) - {n for n in names if n.endswith(("_fwd", "_bwd"))} == {
        "fused_linear_shard", "logits_shard", "merge_shards", "topk_merge_shards", "fused_linear_grad_chunk",
        "products", "product_partials", "product_grads", "accumulate_grad", "scaled", "topk_logprobs"}
    for name in names:
        op = f"nitrobrew::{name}"
        # topk_merge_shards is ATen math on [N, K] tensors: one kernel for every device.
        assert any(torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
                   for key in ("CPU", "CompositeExplicitAutograd")), f"{op} has no CPU kernel"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "Meta"), f"{op} has no fake kernel"
        if name.endswith("_fwd"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "Autograd"), f"{op} has no autograd"


@pytest.mark.parametrize("name", ["fused_linear_fwd", "logits_fwd", "attention_kl_fwd"])
def test_the_divergence_is_a_named_argument_of_the_schema(name):
    schema = getattr(torch.ops.nitrobrew, name).default._schema
    argument = next(a for a in schema.arguments if a.name == "divergence")
    assert str(argument.type) == "str"
