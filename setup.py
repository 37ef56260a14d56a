"""Builds nitrobrew._C: a CUDA extension when a CUDA toolkit and a CUDA build of torch are
present (and NITROBREW_NO_CUDA is not 1), otherwise a CPU-only extension.

    pip install --no-build-isolation .        # or -e . for development

Knobs: NITROBREW_CUDA_ARCHS (default "8.0;9.0a"), NITROBREW_NO_CUDA, DEBUG, MAX_JOBS.
"""

import importlib.util
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))

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


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
