#!/usr/bin/env bash
# Before/after A/B of a change on a GPU machine: builds the checkout at $BASE (the code before the
# change; any folder holding a nitrobrew source tree) in /tmp/nitrobrew_base, then times each problem
# with tools/experiments/ab_builds.py, the two builds alternated process by process. This checkout
# must be built in place and not installed (pip uninstall -y nitrobrew after check.sh build; then
# python setup.py build_ext --inplace reuses its objects), so that PYTHONPATH picks each build.
#   BASE=.ab_base bash tools/gpu/before_after.sh build
#   bash tools/gpu/before_after.sh fused_linear topk_linear ...   (problems of ab_variants.py)
# ROUNDS (default 3) rounds per problem; CSVs and logs to $OUT (default ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
for step in "$@"; do
  if [ "$step" = build ]; then
    rm -rf /tmp/nitrobrew_base && cp -r "${BASE:?BASE names the checkout before the change}" /tmp/nitrobrew_base
    t0=$SECONDS
    (cd /tmp/nitrobrew_base && env CXX=/usr/bin/g++ NITROBREW_CUDA_ARCHS=${NITROBREW_CUDA_ARCHS:-9.0a} \
       MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace) > "$OUT/build_base.log" 2>&1 || status=1
    echo "== build_base: rc=$status in $((SECONDS - t0)) s"; tail -n 3 "$OUT/build_base.log"
    continue
  fi
  t0=$SECONDS
  python3 tools/experiments/ab_builds.py "$step" --build before=/tmp/nitrobrew_base --build after=. \
    --rounds "${ROUNDS:-3}" --out "$OUT/ab_builds_$step.csv" 2>&1 | tee "$OUT/ab_builds_$step.log" || status=1
  echo "== $step: $((SECONDS - t0)) s"
done
exit $status
