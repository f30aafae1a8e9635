"""glassgpt.engine.loss.cross_entropy: the same loss and gradient as F.cross_entropy, chunk by chunk.

Tolerances: losses agree to 1e-6 (the same float32 sums in another order), float32 gradients
to 1e-7 + 1e-5 relative; bfloat16 logits are compared with F.cross_entropy on their float32
copy, and their gradients, which both round to bfloat16 once, to one bfloat16 step of the
largest gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glassgpt.engine.loss import CHUNK_ROWS, IGNORE_INDEX, cross_entropy


def loss_and_grad(fn, logits, targets):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, targets)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("n", [1, CHUNK_ROWS, 3 * CHUNK_ROWS + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_f_cross_entropy(n, dtype):
    torch.manual_seed(0)
    logits = (torch.randn(n, 1000) * 4).to(dtype)
    targets = torch.randint(0, 1000, (n,))
    ours, g_ours = loss_and_grad(cross_entropy, logits, targets)
    ref, g_ref = loss_and_grad(lambda x, t: F.cross_entropy(x.float(), t), logits, targets)
    assert ours.dtype == torch.float32 and g_ours.dtype == dtype
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(g_ours, g_ref, atol=1e-7, rtol=1e-5)
    else:
        step = g_ref.float().abs().max().item() * 2**-8
        torch.testing.assert_close(g_ours.float(), g_ref.float(), atol=step, rtol=0)


def test_ignored_targets_add_nothing():
    torch.manual_seed(1)
    logits = torch.randn(40, 50)
    targets = torch.randint(0, 50, (40,))
    targets[::3] = IGNORE_INDEX
    ours, g_ours = loss_and_grad(cross_entropy, logits, targets)
    ref, g_ref = loss_and_grad(F.cross_entropy, logits, targets)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-8, rtol=1e-5)
    assert (g_ours[::3] == 0).all()


def test_gradient_scales_with_the_upstream_gradient():
    logits = torch.randn(20, 30)
    targets = torch.randint(0, 30, (20,))
    _, g1 = loss_and_grad(cross_entropy, logits, targets)
    _, g3 = loss_and_grad(lambda x, t: 3.0 * cross_entropy(x, t), logits, targets)
    torch.testing.assert_close(g3, 3.0 * g1)


def test_training_through_the_loss_matches_f_cross_entropy(tiny_model):
    # One step of a real model: the parameter gradients agree too.
    ids = torch.randint(0, 97, (2, 12))
    grads = []
    for fn in (cross_entropy, lambda x, t: F.cross_entropy(x.float(), t)):
        tiny_model.zero_grad(set_to_none=True)
        fn(tiny_model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads.append([p.grad.clone() for p in tiny_model.parameters()])
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
