"""train/head_loss.py: the chunked head cross-entropy against the unfused loss written out here."""
import pytest
import torch
import torch.nn.functional as F

from specjet.kernels.cpu_features import has_native_bf16
from specjet.train import head_loss
from specjet.train.head_loss import head_cross_entropy


def problem(n: int, h: int = 48, columns: int = 300, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight_t = torch.randn(h, columns, generator=gen) * 0.3
    targets = torch.randint(0, columns, (n,), generator=gen)
    weights = torch.rand(n, generator=gen)
    weights[1::5] = 0.0  # rows that do not count (the trainer's padding)
    return hidden, weight_t, targets, weights


def unfused(hidden, weight_t, targets, weights):
    logits = (hidden @ weight_t).float()
    loss = (F.cross_entropy(logits, targets, reduction="none") * weights).sum() / weights.sum()
    return loss, logits.detach()


def assert_best(predicted, logits, atol):
    """Each predicted column holds its row's maximum logit (up to the products' rounding: a chunk's matmul may
    block its sums otherwise than the whole one's, so a near-tie may resolve either way on some CPU)."""
    best = logits.max(-1).values
    assert bool((logits.gather(1, predicted[:, None])[:, 0] >= best - atol).all())


@pytest.mark.parametrize("n", [1, 63, 64, 200])  # one chunk, a partial one, several
def test_loss_argmax_and_gradient_equal_the_unfused_loss(n, monkeypatch):
    monkeypatch.setattr(head_loss, "CHUNK_ROWS", 64)
    hidden, weight_t, targets, weights = problem(n)
    loss, predicted = head_cross_entropy(hidden, weight_t, targets, weights)
    (grad,) = torch.autograd.grad(3.0 * loss, hidden)  # a scale on the loss reaches the gradient
    ref_loss, ref_logits = unfused(hidden, weight_t, targets, weights)
    (ref_grad,) = torch.autograd.grad(3.0 * ref_loss, hidden)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert_best(predicted, ref_logits, 1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert bool((grad[weights == 0] == 0).all())  # a weightless row gets no gradient


@pytest.mark.skipif(not has_native_bf16(), reason="bf16 autocast is emulated (slow) without native bf16")
def test_under_bf16_autocast_the_product_runs_in_bf16_as_the_unfused_path():
    hidden, weight_t, targets, weights = problem(130, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, predicted = head_cross_entropy(hidden, weight_t, targets, weights)
        ref_loss, ref_logits = unfused(hidden, weight_t, targets, weights)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, hidden)
    (ref_grad,) = torch.autograd.grad(ref_loss, hidden)
    assert grad.dtype == hidden.dtype
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)  # the same bf16 logits, summed in fp32
    assert_best(predicted, ref_logits, 0.05)  # bf16 logits
    torch.testing.assert_close(grad, ref_grad, rtol=2e-2, atol=2e-3 * float(ref_grad.abs().max()))


def test_refuses_a_trainable_head_and_mismatched_shapes():
    hidden, weight_t, targets, weights = problem(8)
    with pytest.raises(ValueError, match="frozen"):
        head_cross_entropy(hidden, weight_t.clone().requires_grad_(), targets, weights)
    with pytest.raises(ValueError, match=r"targets \[n\]"):
        head_cross_entropy(hidden, weight_t, targets[:5], weights)
