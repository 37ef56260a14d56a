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


@pytest.mark.parametrize("release,archs", [((13, 0), "8.0;9.0a;10.0"), ((12, 8), "8.0;9.0a;10.0"),
                                           ((12, 6), "8.0;9.0a"), ((11, 8), "8.0;9.0a"), (None, "8.0;9.0a")])
def test_blackwell_is_built_where_the_toolkit_has_it(release, archs):
    build = _build_module()
    assert build.default_cuda_archs(release) == archs
    assert build.gencode_flags("10.0") == ["-gencode=arch=compute_100,code=sm_100"]


def test_the_toolkit_release_is_read_from_nvcc(tmp_path):
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    build = _build_module()
    assert build.nvcc_release(str(nvcc)) == (12, 8)
    assert build.nvcc_release(str(tmp_path / "missing")) is None


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


@pytest.mark.parametrize("built,running,ok", [
    (("2.13.0+cpu", None), ("2.13.1+cpu", None), True),     # a patch release: the same ABI
    (("2.11.0+cu130", "13.0"), ("2.11.0+cu128", "12.8"), True),
    (("2.13.0+cpu", None), ("2.14.1+cu130", "13.0"), False),  # the case: another release and a CUDA build
    (("2.11.0+cu130", "13.0"), ("2.11.0+cpu", None), False),
    (("2.10.0", None), ("2.11.0", None), False),
])
def test_an_extension_built_for_another_torch_is_refused_with_the_fix(built, running, ok):
    message = _build_module().torch_mismatch(*built, *running)
    assert (message is None) == ok
    if not ok:
        assert f"built against torch {built[0]}, but torch {running[0]} is installed" in message
        assert "pip install --no-build-isolation" in message and "NITROBREW_JIT_FALLBACK=1" in message


def test_an_isolated_build_stops_at_once_naming_the_flag(tmp_path):
    # pip's build isolation runs setup.py where the installed torch is not visible (torch is not a build
    # requirement): it stops with the flag to use, instead of building against another torch.
    import subprocess
    import sys

    setup_py = os.path.join(os.path.dirname(__file__), os.pardir, "setup.py")
    hidden = tmp_path / "torch"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    result = subprocess.run([sys.executable, setup_py, "--version"], capture_output=True, text=True, env=env,
                            timeout=60, cwd=tmp_path)
    assert result.returncode == 1
    assert "pip install --no-build-isolation ." in result.stderr, result.stderr


def test_importing_a_build_for_another_torch_raises_with_the_fix(tmp_path):
    # The record setup.py writes (nitrobrew/_build_info.py) says another torch: import stops before loading the
    # extension, saying what to do.
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), os.pardir)
    code = ("import sys, types; sys.modules['nitrobrew._build_info'] = types.SimpleNamespace("
            "TORCH_VERSION='2.3.0+cu118', TORCH_CUDA='11.8', WITH_CUDA=True); import nitrobrew")
    env = {k: v for k, v in os.environ.items() if k not in ("NITROBREW_JIT", "NITROBREW_JIT_FALLBACK")}
    env["PYTHONPATH"] = os.path.abspath(root)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=120)
    assert result.returncode == 1
    assert "built against torch 2.3.0+cu118, but torch" in result.stderr, result.stderr
