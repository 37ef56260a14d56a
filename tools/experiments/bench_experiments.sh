#!/usr/bin/env bash
# Times the built package (e.g. bash tools/gpu/check.sh build) on a GPU for comparing kernel
# variants: the forward and the forward + backward at N = 8192 on the reference shape
# (V = 152064, D_s = 3584, D_t = 5120, bf16): median wall time of $REPEATS runs, a result checksum
# (equal across variants that must not change results) and the per-kernel times. One log per
# variant in $OUT (default ./gpu_out), a summary at the end.
#   bash tools/experiments/bench_experiments.sh [VARIANT ...]
# TOKENS=N changes the batch (default 8192). VARIANT: none (the default kernels), or environment assignments joined by '+', for example
# NITROBREW_FORCE_SM80=1. Variants that need a different build are timed one build at a time.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"
variants=${*:-none}
summary="$OUT/experiments_summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$summary"
status=0
for variant in $variants; do
  settings=()
  [ "$variant" = none ] || IFS=+ read -r -a settings <<< "$variant"
  log="$OUT/experiment_${variant//[^A-Za-z0-9_]/_}.log"
  echo "== $variant -> $log"
  : > "$log"
  for mode in --forward-only ""; do
    env "${settings[@]}" python3 tools/profiling/profile_fused_linear.py --tokens "${TOKENS:-8192}" --vocab 152064 \
      --d-student 3584 --d-teacher 5120 --repeats "$REPEATS" --breakdown $mode >> "$log" 2>&1 || status=1
  done
  grep -E "median|check:|Error" "$log" | sed "s/^/$variant: /" | tee -a "$summary"
done
echo "== summary: $summary"
exit $status
