#!/usr/bin/env bash
# Compiles every CUDA source under csrc/ with nvcc (compile only) for the architectures the
# package ships (NITROBREW_CUDA_ARCHS, default 8.0 and 9.0a), against the installed torch's
# headers, and the standalone programs in tools/experiments/ for sm_90a. Needs no GPU. Fails if
# there are CUDA sources and no nvcc.
set -euo pipefail
cd "$(dirname "$0")/../.."
# ONLY=pattern compiles just the sources whose path matches it (grep -E).
# The *_cuda.cpp files are host code of the CUDA build (nitrobrew/_build.py): nvcc hands them to the
# host compiler.
mapfile -t sources < <( (find csrc -name '*.cu'; find csrc -name '*_cuda.cpp') | sort | grep -E "${ONLY:-.}")
# Standalone CUDA programs under tools/experiments/ (no torch; Hopper only).
mapfile -t tools < <(find tools/experiments -maxdepth 1 -name '*.cu' | sort | grep -E "${ONLY:-.}")
if [ $((${#sources[@]} + ${#tools[@]})) -eq 0 ]; then
  echo "compile_cuda: no CUDA sources"
  exit 0
fi
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || { echo "compile_cuda: nvcc not found; set NVCC or install the CUDA toolkit" >&2; exit 1; }
python_=${PYTHON:-python3}
mapfile -t flags < <("$python_" - <<'PY'
import importlib.util, os, sysconfig
import inspect
import torch
from torch.utils import cpp_extension
from torch.utils.cpp_extension import include_paths
print(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
# The standard torch's own build helper would pass (C++20 in recent releases, C++17 before).
print("-std=c++20" if "-std=c++20" in inspect.getsource(cpp_extension) else "-std=c++17")
for flag in cpp_extension.COMMON_NVCC_FLAGS:
    print(flag)
spec = importlib.util.spec_from_file_location("b", os.path.join("nitrobrew", "_build.py"))
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
for flag in b.nvcc_flags():
    print(flag)
for path in include_paths() + [sysconfig.get_paths()["include"], "csrc"]:
    print("-I" + path)
# A CPU build of torch ships c10/cuda headers without their generated config header.
if not any(os.path.exists(os.path.join(p, "c10/cuda/impl/cuda_cmake_macros.h")) for p in include_paths()):
    print("-Itools/ci/cuda_stubs")
PY
)
# KEEP_OBJ=dir keeps the objects there (for cuobjdump -sass); NVCC_EXTRA adds nvcc flags.
if [ -n "${KEEP_OBJ:-}" ]; then
  out=$KEEP_OBJ
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
cuda_include=${CUDA_HOME:-/usr/local/cuda}/include
compiled=0
for src in "${sources[@]}"; do
  # Host code that calls cuBLAS needs its headers, which a bare nvcc install may lack.
  if [[ $src == *.cpp ]] && grep -q "ATen/cuda/CUDAContext.h" "$src" && [ ! -f "$cuda_include/cublas_v2.h" ]; then
    echo "compile_cuda: $src skipped: no cuBLAS headers in $cuda_include"
    continue
  fi
  echo "compile_cuda: $src"
  # --threads: the architectures of one file compile side by side (CI's two cores, once its tests are done; the
  # per-divergence row kernels took the step from ~24 to ~30 min on one core).
  "$NVCC" -c "$src" -o "$out/$(basename "$src").o" --threads "${NVCC_THREADS:-2}" -Xcompiler -fPIC \
    -DTORCH_EXTENSION_NAME=_C "${flags[@]}" ${NVCC_EXTRA:-}
  compiled=$((compiled + 1))
done
for src in "${tools[@]}"; do
  echo "compile_cuda: $src"
  "$NVCC" -std=c++17 -c "$src" -o "$out/$(basename "$src").o" -gencode arch=compute_90a,code=sm_90a ${NVCC_EXTRA:-}
  compiled=$((compiled + 1))
done
echo "compile_cuda: $compiled of $((${#sources[@]} + ${#tools[@]})) CUDA source(s) compiled"
