#!/usr/bin/env bash
# Where a fused-linear forward + backward spends its time, on a GPU machine with the extension built
# (tools/gpu/check.sh build): per shape (N = 8192, bf16, forward KL), the kernels' own timeline
# (profile_fused_linear.py --breakdown: each kernel's total and the idle gaps between them, plus the
# step's median wall time) and every kernel of two steps under ncu at the fixed base clock (cycles,
# DRAM bytes), summed by kind over the second (ncu_step_summary.py). Logs and CSVs go to $OUT
# (default ./gpu_out).
#   bash tools/profiling/backward_budget.sh [qwen] [llama3] [topk128]   (topk128: nitrobrew.topk_kl, K = 128,
#   normalize="full", on the Qwen student's shape)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
declare -A SHAPES=([qwen]="152064 3584 5120" [llama3]="128256 2048 4096" [topk128]="152064 3584 5120")
declare -A TOPK=([topk128]=128)
TOKENS=${TOKENS:-8192}
# sm__cycles_active.avg / sm__cycles_elapsed.max: how busy the SMs were (a launch's partial last wave shows).
metrics=gpu__time_duration.sum,sm__cycles_elapsed.max,sm__cycles_active.avg,dram__bytes_read.sum,dram__bytes_write.sum
for name in ${*:-qwen llama3}; do
  read -r vocab d_s d_t <<< "${SHAPES[$name]}"
  shape=(--tokens "$TOKENS" --vocab "$vocab" --d-student "$d_s" --d-teacher "$d_t" --topk "${TOPK[$name]:-0}")
  echo "== $name: breakdown"
  python3 tools/profiling/profile_fused_linear.py "${shape[@]}" --breakdown --repeats 10 \
    > "$OUT/breakdown_$name.txt" 2>&1
  tail -n 40 "$OUT/breakdown_$name.txt"
  echo "== $name: ncu (every kernel of two steps)"
  ncu --clock-control base --metrics "$metrics" --csv --page raw \
    python3 tools/profiling/profile_fused_linear.py "${shape[@]}" > "$OUT/ncu_$name.csv" 2> "$OUT/ncu_$name.log"
  echo "rc=$? $(wc -l < "$OUT/ncu_$name.csv") lines"
  python3 tools/profiling/ncu_step_summary.py "$OUT/ncu_$name.csv" --shape "$TOKENS,$vocab,$d_s,$d_t"
done
