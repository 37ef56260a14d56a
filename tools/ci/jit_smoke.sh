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
cat > "$work/elsewhere/jit_smoke.py" <<'PY'
import os
import sys

import torch

import nitrobrew

checkout = os.environ["NITROBREW_CHECKOUT"]
assert nitrobrew.__file__.startswith(checkout), f"imported {nitrobrew.__file__}, not the fresh checkout's copy"
g = torch.Generator().manual_seed(0)
xs, xt = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(6, 12, generator=g)
ws, wt = torch.randn(40, 8, generator=g, requires_grad=True), torch.randn(40, 12, generator=g)
loss = nitrobrew.forward_kl(xs, xt, ws, wt)
loss.backward()
q = torch.softmax(xt @ wt.T, -1)
expected = (q * (torch.log_softmax(xt @ wt.T, -1) - torch.log_softmax(xs @ ws.T, -1))).sum(-1).mean()
torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
print(f"JIT smoke test: nitrobrew from {nitrobrew.__file__} (torch {torch.__version__}): ok", file=sys.stderr)
PY
run() {
  (cd "$work/elsewhere" && env -u NITROBREW_JIT_FALLBACK NITROBREW_JIT=1 NITROBREW_CHECKOUT="$work/checkout" \
    PYTHONPATH="$work/checkout" TORCH_EXTENSIONS_DIR="$work/extensions" python3 jit_smoke.py 2>&1)
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
