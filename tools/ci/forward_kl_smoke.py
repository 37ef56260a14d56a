"""The smoke tests' check of an installed or JIT-compiled nitrobrew, run from outside the checkout
(tools/ci/wheel_smoke.sh, tools/ci/jit_smoke.sh): a forward KL and its backward against PyTorch on a tiny
problem. With an argument, nitrobrew must have been imported from below that folder."""

import sys

import torch

import nitrobrew

if len(sys.argv) > 1:
    assert nitrobrew.__file__.startswith(sys.argv[1]), f"imported {nitrobrew.__file__}, not the copy below {sys.argv[1]}"
g = torch.Generator().manual_seed(0)
xs, xt = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(6, 12, generator=g)
ws, wt = torch.randn(40, 8, generator=g, requires_grad=True), torch.randn(40, 12, generator=g)
loss = nitrobrew.forward_kl(xs, xt, ws, wt)
loss.backward()
xs_ref, ws_ref = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
q = torch.softmax(xt @ wt.T, -1)
expected = (q * (torch.log_softmax(xt @ wt.T, -1) - torch.log_softmax(xs_ref @ ws_ref.T, -1))).sum(-1).mean()
expected.backward()
torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(xs.grad, xs_ref.grad, rtol=1e-5, atol=1e-6)
torch.testing.assert_close(ws.grad, ws_ref.grad, rtol=1e-5, atol=1e-6)
print(f"smoke test: nitrobrew {nitrobrew.__version__} from {nitrobrew.__file__} (torch {torch.__version__}): loss and "
      f"gradients ok")
