#!/usr/bin/env bash
# The CPU wheel for the installed torch (make wheel's command), installed with that torch into a fresh venv outside
# the checkout, then imported and run there: the wheel a user gets, not the checkout (issue 45).
set -euo pipefail
cd "$(dirname "$0")/../.."
checkout=$PWD
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 -m pip wheel -q --no-build-isolation --no-deps -w "$out/dist" .
torch_version=$(python3 -c "import torch; print(torch.__version__.split('+')[0])")
python3 -m venv "$out/venv"
"$out/venv/bin/pip" install -q "torch==$torch_version" "$out"/dist/nitrobrew-*.whl
cd "$out"
"$out/venv/bin/python" - <<'PY'
import importlib.metadata

import torch

import nitrobrew

meta = importlib.metadata.metadata("nitrobrew")
release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
assert meta["Version"].startswith("0.1.0+pt" + release.replace(".", "")), meta["Version"]
assert f"torch=={release}.*" in meta.get_all("Requires-Dist"), meta.get_all("Requires-Dist")
assert "site-packages" in nitrobrew.__file__, nitrobrew.__file__  # the wheel's copy, not a checkout
print(f"wheel smoke test: nitrobrew {meta['Version']} (torch {torch.__version__})")
PY
"$out/venv/bin/python" "$checkout/tools/ci/forward_kl_smoke.py" "$out/venv"
