"""Loads the compiled kernels that register the torch.ops.nitrobrew operators.

Normally this imports the extension built by `pip install --no-build-isolation .`.
With NITROBREW_JIT=1 it compiles the same sources from a source checkout with
torch.utils.cpp_extension.load instead (cached in torch's extension folder), which is
the quick loop for kernel development. There is no fallback to slower code: a missing
build is an ImportError that says how to build, and so is a build for another torch
(nitrobrew/_build_info.py, written by setup.py, records the build's), unless
NITROBREW_JIT_FALLBACK=1 asks for the JIT path then.
"""

from __future__ import annotations

import os

from nitrobrew import _build

_BUILD_HINT = (
    "nitrobrew's compiled extension (nitrobrew._C) is not built. Build it with\n"
    "    pip install --no-build-isolation .      (or: pip install --no-build-isolation -e .)\n"
    "from the repository root (torch must already be installed), or set NITROBREW_JIT=1 to\n"
    "compile it on import from a source checkout."
)


def _jit_build_cached() -> bool:
    """Whether torch's extension folder holds a JIT build of nitrobrew (its build directory is a private helper
    of torch.utils.cpp_extension; without it, assume not)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return os.path.exists(os.path.join(_get_build_directory("nitrobrew_jit", verbose=False), "nitrobrew_jit.so"))
    except Exception:
        return False


def _jit_load() -> None:
    from torch.utils.cpp_extension import load

    root = _build.source_root()
    sources = _build.cpp_sources(root)
    if not sources:
        raise ImportError(f"NITROBREW_JIT=1 needs a source checkout; no csrc/ under {root}")
    with_cuda = _build.cuda_wanted()
    if with_cuda:
        sources += _build.cuda_sources(root)
    if not _jit_build_cached():
        import sys

        # The first import compiles for minutes (later ones load torch's cached build): say so rather than sit silent.
        print(f"nitrobrew: building the extension{' with CUDA' if with_cuda else ''} (NITROBREW_JIT; the first import "
              "takes a few minutes, later ones load the cached build)...", file=sys.stderr, flush=True)
    load(
        name="nitrobrew_jit",
        sources=sources,
        extra_include_paths=[os.path.join(root, "csrc")],
        extra_cflags=_build.cxx_flags() + (["-DNITROBREW_WITH_CUDA"] if with_cuda else []),
        extra_cuda_cflags=_build.nvcc_flags() if with_cuda else None,
        with_cuda=with_cuda,
        is_python_module=False,  # the shared object only registers operators
        verbose=os.environ.get("NITROBREW_JIT_VERBOSE", "0") == "1",
    )


def _check_build_torch() -> bool:
    """True if the extension was built against the running torch (or its build recorded nothing); False if not
    and NITROBREW_JIT_FALLBACK=1 asks for the JIT path instead; else an ImportError that says what to do."""
    try:
        from nitrobrew import _build_info
    except ImportError:  # a build older than the record, or not built by setup.py
        return True
    import torch

    problem = _build.torch_mismatch(_build_info.TORCH_VERSION, _build_info.TORCH_CUDA, torch.__version__, torch.version.cuda)
    if problem is None:
        return True
    if os.environ.get("NITROBREW_JIT_FALLBACK", "0") == "1":
        return False
    raise ImportError(problem)


def load_extension() -> None:
    if os.environ.get("NITROBREW_JIT", "0") == "1":
        _jit_load()
        return
    if not _check_build_torch():  # built against another torch; NITROBREW_JIT_FALLBACK=1 compiles this one's
        _jit_load()
        return
    import importlib.util

    if importlib.util.find_spec("nitrobrew._C") is None:  # not built: say how, without Python's import noise
        raise ImportError(_BUILD_HINT) from None
    try:
        from nitrobrew import _C  # noqa: F401  (importing registers the operators)
    except ImportError as error:  # built, but it does not load (another torch, a missing library)
        raise ImportError(f"nitrobrew's compiled extension (nitrobrew._C) did not load: {error}\nRebuild it against "
                          f"the installed torch with\n    pip install --no-build-isolation .\nor set NITROBREW_JIT=1 "
                          f"to compile it on import from a source checkout.") from error


def kernel_device_types(op: str) -> frozenset:
    """The device types ("cpu", "cuda") this build registered kernels of nitrobrew::op for."""
    import torch

    return frozenset(
        device
        for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"nitrobrew::{op}", key)
    )
