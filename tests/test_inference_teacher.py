"""Teacher tensors made under torch.inference_mode (how a frozen teacher's forward usually runs): every
loss takes them as they are, without copying them for the backward (for logits the copy would be
[N x V]), and gives the same loss and gradients as with ordinary tensors."""

from __future__ import annotations

import pytest
import torch

import nitrobrew


def _logits(device):
    g = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(2, 13, 300, generator=g), torch.randn(2, 13, 300, generator=g)
    return [zs.to(device)], [zt.to(device)], lambda s, t: nitrobrew.logits.jsd(s[0], t[0], beta=0.3)


def _topk_logits(device):
    g = torch.Generator().manual_seed(1)
    zs = torch.randn(13, 300, generator=g)
    lps, ids = torch.randn(13, 300, generator=g).log_softmax(-1).topk(9, dim=-1)
    return [zs.to(device)], [ids.to(device), lps.to(device)], lambda s, t: nitrobrew.logits.topk_kl(s[0], *t)


def _fused_linear(device, grad_in_forward=False):
    g = torch.Generator().manual_seed(2)
    student = [torch.randn(13, 24, generator=g), torch.randn(300, 24, generator=g) / 5]
    teacher = [torch.randn(13, 40, generator=g), torch.randn(300, 40, generator=g) / 6]
    return ([t.to(device) for t in student], [t.to(device) for t in teacher],
            lambda s, t: nitrobrew.forward_kl(s[0], t[0], s[1], t[1], grad_in_forward=grad_in_forward))


def _topk_linear(device):
    g = torch.Generator().manual_seed(3)
    student = [torch.randn(13, 24, generator=g), torch.randn(300, 24, generator=g) / 5]
    lps, ids = torch.randn(13, 300, generator=g).log_softmax(-1).topk(9, dim=-1)
    return ([t.to(device) for t in student], [ids.to(device), lps.to(device)],
            lambda s, t: nitrobrew.topk_kl(s[0], s[1], *t))


def _attention(device):
    g = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the CUDA kernels take 16-bit inputs
    q_s, k_s, q_t, k_t = (torch.randn(1, 37, 2, 64, generator=g).to(device, dtype) for _ in range(4))
    return [q_s, k_s], [q_t, k_t], lambda s, t: nitrobrew.attention_kl(s[0], s[1], t[0], t[1], causal=True)


def _held_tensors(loss):
    """The inference tensors the loss's custom-op node holds for its backward."""
    held, stack, seen = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        held += list(getattr(node, "held_inference_tensors", {}).values())
        stack += [next_node for next_node, _ in node.next_functions]
    return held


def _losses_and_held(make, device):
    student, teacher, loss_fn = make(device)
    with torch.inference_mode():
        teacher_inference = [t.clone() for t in teacher]
    results = []
    for teacher_tensors in (teacher, teacher_inference):
        leaves = [s.detach().clone().requires_grad_() for s in student]
        loss = loss_fn(leaves, teacher_tensors)
        held = _held_tensors(loss)
        grads = torch.autograd.grad(loss, leaves)
        results.append((loss.detach(), grads, held))
    return teacher_inference, results


def _assert_same_results(results):
    (loss, grads, _), (loss_inf, grads_inf, _) = results
    torch.testing.assert_close(loss_inf, loss, rtol=0, atol=0)
    for g_inf, g in zip(grads_inf, grads):
        torch.testing.assert_close(g_inf, g, rtol=0, atol=0)


@pytest.mark.parametrize("make", [_logits, _topk_logits, _fused_linear, _topk_linear, _attention])
def test_inference_mode_teacher_is_held_not_copied(make, device):
    teacher_inference, results = _losses_and_held(make, device)
    (_, _, held_plain), (_, _, held) = results
    assert held_plain == []
    # Held as they are (views at most), not copied: the same memory as the caller's tensors.
    memory = {t.untyped_storage().data_ptr() for t in teacher_inference}
    assert held and all(h.untyped_storage().data_ptr() in memory for h in held)
    assert len(held) == len(teacher_inference)
    _assert_same_results(results)


def test_training_path_holds_no_teacher_tensor(device):
    # The training path forms the gradients in the forward: the teacher's tensors are done with then.
    _, results = _losses_and_held(lambda d: _fused_linear(d, grad_in_forward=True), device)
    assert all(held == [] for _, _, held in results)
    _assert_same_results(results)
