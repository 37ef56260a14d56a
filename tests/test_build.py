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


def test_a_checkout_without_a_build_says_how_to_build(tmp_path):
    # The package's Python files alone (no nitrobrew/_C): the import error is the build hint, with none of
    # Python's "partially initialized module ... circular import" noise.
    import shutil
    import subprocess
    import sys

    package = os.path.join(os.path.dirname(__file__), os.pardir, "nitrobrew")
    shutil.copytree(package, tmp_path / "nitrobrew", ignore=shutil.ignore_patterns("_C*", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("NITROBREW_JIT", "PYTHONPATH")}
    # This copy first, past any editable install's import hook (pip install -e puts one on sys.meta_path).
    script = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
              f"sys.path.insert(0, {str(tmp_path)!r}); import nitrobrew")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert "nitrobrew's compiled extension (nitrobrew._C) is not built" in result.stderr, result.stderr
    assert "pip install --no-build-isolation" in result.stderr
    assert "circular import" not in result.stderr and "partially initialized" not in result.stderr, result.stderr
