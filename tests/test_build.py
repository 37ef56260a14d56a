"""Build configuration (nitrobrew/_build.py): the architecture list becomes nvcc flags."""

import importlib.util
import os

import pytest


def _build_module():
    path = os.path.join(os.path.dirname(__file__), os.pardir, "nitrobrew", "_build.py")
    spec = importlib.util.spec_from_file_location("nitrobrew_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architectures_become_gencode_flags():
    assert _build_module().gencode_flags("8.0; 9.0a,8.9") == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_89,code=sm_89",
    ]


@pytest.mark.parametrize("archs,match", [("9.0", "9.0a, not 9.0"), ("8.0;90", "9.0a, not 9.0"), (" ; ", "no architecture")])
def test_bad_architecture_lists_are_refused(archs, match):
    with pytest.raises(ValueError, match=match):
        _build_module().gencode_flags(archs)
