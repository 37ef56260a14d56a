"""Sources and compiler flags of the compiled extension, shared by setup.py and the JIT path, and which torch
a build can run under.

Build knobs (environment variables):
  NITROBREW_CUDA_ARCHS  CUDA architectures, ';'- or ','-separated (default "8.0;9.0a", and "10.0" where the
                        CUDA toolkit has Blackwell, 12.8 or later)
  NITROBREW_NO_CUDA=1   build the CPU-only extension even where CUDA is available
  DEBUG=1               -O0 -g host code, -G -lineinfo device code
  NITROBREW_DEV_KNOBS=1 a development build: compiles in the measuring and testing switches that
                        shipped builds lack (docs/development.md)
  MAX_JOBS              parallel compile jobs (read by torch.utils.cpp_extension)
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

# Ampere's mma.sync kernels (their sm_80 binary runs on every sm_8x GPU) and Hopper's wgmma/TMA ones.
DEFAULT_CUDA_ARCHS = "8.0;9.0a"
# Blackwell (sm_100: B200, GB200; its binary runs on every sm_10x GPU) runs the mma.sync kernels, built where
# the toolkit knows it. (Consumer Blackwell, sm_120, is another major version: NITROBREW_CUDA_ARCHS="12.0".)
BLACKWELL_ARCH, BLACKWELL_MIN_NVCC = "10.0", (12, 8)


def nvcc_release(nvcc: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of the CUDA toolkit's nvcc (torch's CUDA_HOME, else the PATH's), or None without one."""
    if nvcc is None:
        from torch.utils.cpp_extension import CUDA_HOME

        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else "nvcc"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return (int(match.group(1)), int(match.group(2))) if match else None


def default_cuda_archs(release: tuple[int, int] | None) -> str:
    """The architectures built unless NITROBREW_CUDA_ARCHS says otherwise, for a toolkit of that release."""
    if release is not None and release >= BLACKWELL_MIN_NVCC:
        return f"{DEFAULT_CUDA_ARCHS};{BLACKWELL_ARCH}"
    return DEFAULT_CUDA_ARCHS


def source_root() -> str:
    """The repository root, where csrc/ lives (a source checkout)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _csrc(root: str, pattern: str) -> list[str]:
    return glob.glob(os.path.join(root, "csrc", "**", pattern), recursive=True)


def cpp_sources(root: str) -> list[str]:
    """Sources of every build: the schemas, the checks and the CPU kernels (*.cpp but *_cuda.cpp)."""
    return sorted(p for p in _csrc(root, "*.cpp") if not p.endswith("_cuda.cpp"))


def cuda_sources(root: str) -> list[str]:
    """Sources of the CUDA build alone: the kernels (*.cu) and their host code (*_cuda.cpp)."""
    return sorted(_csrc(root, "*.cu") + _csrc(root, "*_cuda.cpp"))


def cuda_wanted() -> bool:
    """A CUDA build needs a CUDA build of torch and a CUDA toolkit, and is not switched off."""
    if os.environ.get("NITROBREW_NO_CUDA", "0") == "1":
        return False
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    return torch.version.cuda is not None and CUDA_HOME is not None


def gencode_flags(archs: str | None = None) -> list[str]:
    """'8.0;9.0a' -> ['-gencode=arch=compute_80,code=sm_80', '-gencode=arch=compute_90a,code=sm_90a']."""
    if archs is None:
        archs = os.environ.get("NITROBREW_CUDA_ARCHS") or default_cuda_archs(nvcc_release())
    flags = []
    for arch in archs.replace(",", ";").split(";"):
        arch = arch.strip()
        if not arch:
            continue
        number = arch.replace(".", "")
        if number == "90":
            # The Hopper kernels exist only in an sm_90a build; a plain sm_90 cubin would load on
            # an H100 with their bodies compiled out, and the host could not tell.
            raise ValueError("NITROBREW_CUDA_ARCHS: build Hopper as 9.0a, not 9.0 (the wgmma/TMA kernels need sm_90a)")
        flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
    if not flags:
        raise ValueError(f"NITROBREW_CUDA_ARCHS names no architecture: {archs!r}")
    return flags


def debug() -> bool:
    return os.environ.get("DEBUG", "0") == "1"


def dev_knobs() -> bool:
    return os.environ.get("NITROBREW_DEV_KNOBS", "0") == "1"


def _knob_defines() -> list[str]:
    return ["-DNITROBREW_DEV_KNOBS"] if dev_knobs() else []


def cxx_flags() -> list[str]:
    return (["-O0", "-g"] if debug() else ["-O3"]) + _knob_defines()


def nvcc_flags() -> list[str]:
    base = ["-O0", "-G", "-lineinfo"] if debug() else ["-O3", "-lineinfo"]
    # The C++ standard is left to torch.utils.cpp_extension, which picks the one its headers need.
    return base + ["--expt-relaxed-constexpr", "-DNITROBREW_WITH_CUDA"] + _knob_defines() + gencode_flags()


def torch_mismatch(built_version: str, built_cuda, running_version: str, running_cuda):
    """Why an extension compiled against torch `built_version` (CUDA `built_cuda`, None for a CPU build of
    torch) cannot run under `running_version`, or None when it can: torch's C++ ABI changes between releases
    (major.minor) and between its CPU and CUDA builds."""
    def release(version):
        return tuple(version.split("+")[0].split(".")[:2])

    if release(built_version) == release(running_version) and (built_cuda is None) == (running_cuda is None):
        return None
    return (f"nitrobrew's compiled extension was built against torch {built_version}, but torch {running_version} is "
            f"installed: it would fail to load, or worse, misbehave. Rebuild nitrobrew against this torch (from its "
            f"checkout: pip install --no-build-isolation --force-reinstall --no-deps .), or set "
            f"NITROBREW_JIT_FALLBACK=1 to compile it on import from a source checkout instead.")
