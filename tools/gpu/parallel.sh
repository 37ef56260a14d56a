#!/usr/bin/env bash
# Several check.sh runs at once on one GPU machine, each under a time limit; their logs come back as one
# tarball. For steps that share the GPU well: tests and compute-sanitizer runs (CPU-bound), not benchmarks.
#   bash tools/gpu/parallel.sh LIMIT_S "RUN" ["RUN" ...]
# Each RUN is check.sh's steps, optionally preceded by VAR=value words (no spaces in a value; FAMILIES and
# SANITIZE_* take commas), e.g.
#   bash tools/gpu/check.sh build &&
#   bash tools/gpu/parallel.sh 400 test_training "SANITIZE_TOOLS=racecheck FAMILIES=fused_linear,topk_linear sanitize"
# Build first (one build serves every run). Run i writes its logs under $OUT/run_i/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
limit=$1; shift
i=0
for spec in "$@"; do
  i=$((i + 1))
  vars=() steps=()
  for word in $spec; do
    if [ ${#steps[@]} -eq 0 ] && [[ $word == *=* ]]; then vars+=("${word//,/ }"); else steps+=("$word"); fi
  done
  mkdir -p "$OUT/run_$i"
  echo "$spec" > "$OUT/run_$i/spec.txt"
  env OUT="$OUT/run_$i" NITROBREW_PACK_OUT=0 "${vars[@]}" timeout -k 5 "$limit" bash tools/gpu/check.sh "${steps[@]}" \
    > "$OUT/run_$i/check.txt" 2>&1 &
done
wait
for d in "$OUT"/run_*; do
  echo "== $(basename "$d"): $(cat "$d/spec.txt")"
  grep -h "^== .*rc=" "$d/check.txt" || echo "   (no step finished within ${limit} s)"
  for f in "$d"/*.log; do [ -e "$f" ] && { echo "-- $(basename "$f")"; tail -n 3 "$f"; }; done
done
tar czf "$OUT/parallel_$(date +%H%M%S).tgz" -C "$OUT" $(cd "$OUT" && ls -d run_*) && rm -rf "$OUT"/run_*
