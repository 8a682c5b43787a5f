"""kernels/training_norm.py: RMSNorm's written-out backward against autograd through the norm's plain ops."""
import pytest
import torch

from specjet.models.llama import RMSNorm


def plain(x, weight, eps):
    """RMSNorm.forward's ops, left to autograd."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 48), (2, 7, 48)])
def test_the_training_norm_is_autograds_of_the_plain_norm(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape))
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    x = (torch.randn(*shape, generator=gen) * 3.0).to(dtype).requires_grad_()
    grad = torch.randn(*shape, generator=gen)
    out = norm(x)
    out.backward(grad)
    ours = (out.detach(), x.grad, norm.weight.grad)
    x.grad, norm.weight.grad = None, None
    ref = plain(x, norm.weight, 1e-5)
    ref.backward(grad)
    assert torch.equal(ours[0], ref.detach())  # the same forward ops: the same bits
    assert ours[1].dtype == dtype and norm.weight.grad.dtype == torch.float32
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours[1].float(), x.grad.float(), **tol)
    torch.testing.assert_close(ours[2], norm.weight.grad, rtol=1e-5, atol=1e-5)


def test_only_the_gradients_asked_for_and_inference_keeps_the_plain_ops():
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16, requires_grad=True)
    norm.weight.requires_grad_(False)
    (grad_x,) = torch.autograd.grad(norm(x).sum(), x)  # a frozen weight: x's gradient alone
    norm.weight.requires_grad_(True)
    ref = plain(x, norm.weight.detach(), 1e-6)
    (ref_grad,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(grad_x, ref_grad, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        out = norm(x)
    assert out.grad_fn is None and torch.equal(out, plain(x.detach(), norm.weight.detach(), 1e-6))
    (grad_w,) = torch.autograd.grad(norm(x.detach()).sum(), norm.weight)  # an input without a gradient
    torch.testing.assert_close(grad_w, plain(x.detach(), torch.ones(16), 1e-6).sum(0), rtol=1e-5, atol=1e-6)
