#!/usr/bin/env bash
# Times the kernel experiments of benchmarks/NOTES.md ("What would close the gap", item 3) on a
# GPU, with the package already built (e.g. bash tools/gpu_check.sh build): for each variant, the
# forward and the forward + backward at N = 8192 on the reference shape (V = 152064, D_s = 3584,
# D_t = 5120, bf16): median wall time of $REPEATS runs, a result checksum (equal across variants)
# and the per-kernel times. One log per variant in $OUT (default ./gpu_out), a summary at the end.
#   bash tools/bench_experiments.sh [VARIANT ...]
# VARIANT: none, or flags of NITROBREW_EXPERIMENT joined by '+' (default: all four below).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
REPEATS=${REPEATS:-5}
mkdir -p "$OUT"
variants=${*:-none stream_dz l2_hints stream_dz+l2_hints}
summary="$OUT/experiments_summary.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$summary"
status=0
for variant in $variants; do
  flags=${variant//+/,}
  [ "$variant" = none ] && flags=
  log="$OUT/experiment_$variant.log"
  echo "== $variant: NITROBREW_EXPERIMENT='$flags' -> $log"
  : > "$log"
  for mode in --forward-only ""; do
    NITROBREW_EXPERIMENT=$flags python3 tools/profile_fused_linear.py --tokens 8192 --vocab 152064 \
      --d-student 3584 --d-teacher 5120 --repeats "$REPEATS" --breakdown $mode >> "$log" 2>&1 || status=1
  done
  grep -E "median|check:|Error" "$log" | sed "s/^/$variant: /" | tee -a "$summary"
done
echo "== summary: $summary"
exit $status
