"""Builds nitrobrew._C: a CUDA extension when a CUDA toolkit and a CUDA build of torch are
present (and NITROBREW_NO_CUDA is not 1), otherwise a CPU-only extension.

    pip install --no-build-isolation .        # or -e . for development

Knobs: NITROBREW_CUDA_ARCHS (default "8.0;9.0a"), NITROBREW_NO_CUDA, DEBUG, MAX_JOBS.
"""

import importlib.util
import os
import sys

# nitrobrew is compiled against the torch it will run with. pip's default build isolation would install another
# torch (often a CUDA build of the newest release) into a temporary environment and build against that; with torch
# left out of the build requirements, such a build stops here at once instead.
try:
    import torch
except ImportError:
    sys.exit("nitrobrew builds against the torch you have installed, which this build environment cannot see: "
             "install torch first, then build with pip's --no-build-isolation flag:\n"
             "    pip install --no-build-isolation .")

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
BASE_VERSION = "0.1.0"

# nitrobrew/_build.py holds the source list and flags, shared with the JIT path; load it
# by path so that the package itself (which needs the built extension) is not imported.
_spec = importlib.util.spec_from_file_location("nitrobrew_build", os.path.join(ROOT, "nitrobrew", "_build.py"))
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


def relative(paths):
    return [os.path.relpath(p, ROOT) for p in paths]


def extension():
    include_dirs = [os.path.join(ROOT, "csrc")]
    if build.cuda_wanted():
        return CUDAExtension(
            "nitrobrew._C",
            relative(build.cpp_sources(ROOT) + build.cuda_sources(ROOT)),
            include_dirs=include_dirs,
            define_macros=[("NITROBREW_WITH_CUDA", None)],
            extra_compile_args={"cxx": build.cxx_flags(), "nvcc": build.nvcc_flags()},
        )
    return CppExtension(
        "nitrobrew._C",
        relative(build.cpp_sources(ROOT)),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": build.cxx_flags()},
    )


def torch_release() -> tuple:
    """(major, minor) of the torch this build compiles against."""
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def torch_tag() -> str:
    """The local version tag of a build: the torch it was compiled against, e.g. pt211cu130 or pt213cpu."""
    major, minor = torch_release()
    return f"pt{major}{minor}" + (f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")


def write_build_info() -> None:
    """nitrobrew/_build_info.py: what the import compares with the running torch (nitrobrew/_extension.py)."""
    with open(os.path.join(ROOT, "nitrobrew", "_build_info.py"), "w") as f:
        f.write("# Written by setup.py: the torch that nitrobrew._C was compiled against (not in git).\n"
                f"TORCH_VERSION = {torch.__version__!r}\nTORCH_CUDA = {torch.version.cuda!r}\n"
                f"WITH_CUDA = {build.cuda_wanted()!r}\n")


class SharedBuildTemp(BuildExtension):
    """build_ext whose objects stay in build/temp-<torch tag>-<python tag> for every kind of build: setuptools
    gives an editable install a fresh temporary folder, so a wheel built after it (CI builds both) compiled
    everything again. ninja recompiles what changed, or was compiled with other flags."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", f"temp-{torch_tag()}-{sys.implementation.cache_tag}")


major, minor = torch_release()
if (major, minor) < (2, 4):
    sys.exit(f"nitrobrew needs torch >= 2.4, found {torch.__version__}")
write_build_info()
setup(
    # The wheel says which torch it needs: a local version tag and a pin to that torch release (its C++ ABI).
    version=f"{BASE_VERSION}+{torch_tag()}",
    install_requires=[f"torch=={major}.{minor}.*"],
    ext_modules=[extension()],
    cmdclass={"build_ext": SharedBuildTemp},
)
