#!/usr/bin/env bash
# One call on a GPU machine: build, GPU tests, compute-sanitizer, benchmarks. Results and logs
# go to $OUT (or ./gpu_out). Usage:
#   bash tools/gpu_check.sh [build|test|test_sm80|sanitize|sanitize_attention|bench|bench_topk|bench_attention ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
steps=${*:-build test test_sm80 sanitize sanitize_attention bench bench_attention}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} NITROBREW_CUDA_ARCHS=${NITROBREW_CUDA_ARCHS:-9.0a}
status=0
# Python packages the GPU machine lacks (liger-kernel for the benchmarks' peer), carried as wheels in
# .whl/ (pip download --no-deps ... -d .whl NAME==VERSION on a machine with a registry).
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/nitrobrew_site .whl/*.whl &&
    export PYTHONPATH=/tmp/nitrobrew_site${PYTHONPATH:+:$PYTHONPATH}
fi
run() {  # run NAME CMD...: log to $OUT/NAME.log, remember failures
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 25 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
for step in $steps; do
  case $step in
    # The system g++ where there is one: on the H100 machine the preset CXX (/opt/gcc/bin/g++, a
    # wrapper around another g++ build) produced an extension whose C++ exceptions segfaulted
    # instead of reaching Python. NITROBREW_BUILD_CXX overrides.
    build) run build env CXX="${NITROBREW_BUILD_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || echo "${CXX:-c++}")}" \
             python3 -m pip install --no-build-isolation --no-deps -v -e . ;;
    test) run test python3 -m pytest tests -q -x -k cuda -p no:cacheprovider ;;
    # The sm_80 (mma.sync) kernels, forced on this GPU (test_cuda_kernels.py covers both itself).
    test_sm80) run test_sm80 env NITROBREW_FORCE_SM80=1 python3 -m pytest tests -q -x -k "cuda and not test_cuda_kernels" -p no:cacheprovider ;;
    sanitize)
      run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_fused_linear.py
      run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_fused_linear.py
      run memcheck_sm80 env NITROBREW_FORCE_SM80=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_fused_linear.py
      run racecheck_sm80 env NITROBREW_FORCE_SM80=1 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_fused_linear.py
      run memcheck_logits compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_logit_distill.py
      run racecheck_logits compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_logit_distill.py
      run memcheck_topk compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_topk_linear.py
      run racecheck_topk compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_topk_linear.py
      run memcheck_topk_sm80 env NITROBREW_FORCE_SM80=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_topk_linear.py ;;
    sanitize_attention)
      run memcheck_attention compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_attention_kl.py
      run racecheck_attention compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_attention_kl.py
      run memcheck_attention_sm80 env NITROBREW_FORCE_SM80=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_attention_kl.py
      run racecheck_attention_sm80 env NITROBREW_FORCE_SM80=1 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_attention_kl.py ;;
    bench) run bench python3 benchmarks/fused_linear.py --device cuda --repeats 5 --out "$OUT/fused_linear_cuda.csv" ;;
    bench_topk) run bench_topk python3 benchmarks/topk_linear.py --device cuda --out "$OUT/topk_linear_cuda.csv" ;;
    bench_attention) run bench_attention python3 benchmarks/attention_kl.py --device cuda --out "$OUT/attention_kl_cuda.csv" ;;
  esac
done
exit $status
