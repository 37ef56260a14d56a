#!/usr/bin/env bash
# The CPU wheel for the installed torch (make wheel's command), installed with that torch into a fresh venv outside
# the checkout, then imported and run there: the wheel a user gets, not the checkout (issue 45).
set -euo pipefail
cd "$(dirname "$0")/../.."
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
g = torch.Generator().manual_seed(0)
xs, xt = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(6, 12, generator=g)
ws, wt = torch.randn(40, 8, generator=g, requires_grad=True), torch.randn(40, 12, generator=g)
loss = nitrobrew.forward_kl(xs, xt, ws, wt)
loss.backward()
q = torch.softmax(xt @ wt.T, -1)
expected = (q * (torch.log_softmax(xt @ wt.T, -1) - torch.log_softmax(xs @ ws.T, -1))).sum(-1).mean()
torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
print(f"wheel smoke test: nitrobrew {meta['Version']} from {nitrobrew.__file__} (torch {torch.__version__}): ok")
PY
