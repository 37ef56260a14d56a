#!/usr/bin/env bash
# The JIT path as docs/development.md gives it (issue 45): a fresh copy of the checkout (its committed files: no
# build, no nitrobrew/_C), imported with NITROBREW_JIT=1 by a script outside it through PYTHONPATH, compiled into
# an empty extension folder, then a forward KL and its backward against PyTorch. A second import loads the cached
# build without compiling.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/checkout" "$work/elsewhere"
git archive --format=tar HEAD | tar -x -C "$work/checkout"
run() {
  (cd "$work/elsewhere" && env -u NITROBREW_JIT_FALLBACK NITROBREW_JIT=1 PYTHONPATH="$work/checkout" \
    TORCH_EXTENSIONS_DIR="$work/extensions" python3 "$work/checkout/tools/ci/forward_kl_smoke.py" "$work/checkout" 2>&1)
}
t0=$SECONDS
first=$(run)
echo "$first"
grep -q "nitrobrew: building the extension" <<< "$first" || { echo "jit_smoke: the first import did not say it builds" >&2; exit 1; }
echo "jit_smoke: first import (compiled) in $((SECONDS - t0)) s"
t0=$SECONDS
second=$(run)
if grep -q "building the extension" <<< "$second"; then echo "jit_smoke: the second import compiled again" >&2; exit 1; fi
echo "jit_smoke: second import (cached build) in $((SECONDS - t0)) s: ok"
