"""The training path of the projections (kernels/linear.py ``linear`` without a packed
weight) under bf16 autocast.

On an Intel Xeon with AMX, torch 2.13's oneDNN died with SIGFPE while building the bf16 matmul for the
LM head's input gradient at 32 rows x 49,152 ids (the DFlash trainer's tiny-model test crashed the
whole pytest worker). The products run in a child process, so a crash fails this test instead of
taking the test worker down. On a CPU without AMX the products take other kernels and these
checks only pin the values."""
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import sys, torch
    from specjet.kernels.linear import linear
    rows, inp, out, bias, frozen = (int(a) for a in sys.argv[1:6])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, inp, generator=gen).requires_grad_()
    weight_t = (torch.randn(inp, out, generator=gen) / inp ** 0.5).requires_grad_(not frozen)
    b = torch.randn(out, generator=gen).requires_grad_() if bias else None
    grad = torch.randn(rows, out, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, weight_t, b, None)
    assert y.dtype == torch.bfloat16, y.dtype
    y.float().backward(grad)
    # Against the fp32 product of the bf16-rounded operands (what autocast multiplies).
    xr, wr = x.detach().bfloat16().float(), weight_t.detach().bfloat16().float()
    ref = xr @ wr + (0 if b is None else b.detach().bfloat16().float())
    g = grad.bfloat16().float()
    scale = lambda t: t.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= 0.02 * scale(ref), "forward"
    assert (x.grad - g @ wr.t()).abs().max().item() <= 0.02 * scale(g @ wr.t()), "input gradient"
    if frozen:
        assert weight_t.grad is None
    else:
        assert (weight_t.grad - xr.t() @ g).abs().max().item() <= 0.02 * scale(xr.t() @ g), "weight gradient"
    print("ok")
""")


@pytest.mark.parametrize("rows,inp,out,bias,frozen", [
    (32, 576, 49152, 0, 0),   # the shape that crashed: the default model's full-vocabulary head, 32 scored rows
    (32, 576, 49152, 0, 1),   # the same head frozen (a target's, under a draft being trained)
    (32, 64, 49152, 0, 0),    # the tiny test model's head
    (24, 576, 65536, 0, 0),   # a larger vocabulary's crashing row count
    (7, 576, 8192, 1, 0),     # a hot-vocabulary head, an odd row count, a bias
    (300, 576, 3072, 0, 0),   # a draft layer's projections (gate and up, down), as the DFlash trainer runs them
    (300, 1536, 576, 1, 0),
])
def test_bf16_autocast_training_product_and_its_gradients(rows, inp, out, bias, frozen):
    done = subprocess.run([sys.executable, "-c", CHILD, str(rows), str(inp), str(out), str(bias), str(frozen)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])


def test_a_frozen_weight_keeps_its_casts_that_follow_its_changes():
    """A frozen weight (a target's head under a draft being trained) is cast and transposed once, not
    every call: its product and the input's gradient are those of the same weight trained (cast every
    call), bit for bit, and an in-place change of the weight (a new version) is seen by the next call."""
    import torch

    from specjet.kernels import linear as L
    from specjet.kernels.training_linear import frozen_casts

    gen = torch.Generator().manual_seed(0)
    weight_t = torch.randn(64, 96, generator=gen) / 8  # frozen: no grad
    x = torch.randn(5, 64, generator=gen).requires_grad_()

    def trained_twin():
        """(product, input gradient) through the same weight as a trainable one."""
        twin, xt = weight_t.clone().requires_grad_(), x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = L.linear(xt, twin, None, None)
        y.float().sum().backward()
        assert twin.grad is not None
        return y.detach(), xt.grad

    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = L.linear(x, weight_t, None, None)
        again = L.linear(x, weight_t, None, None)
        casts = frozen_casts(weight_t, torch.bfloat16)
        assert all(a is b for a, b in zip(casts, frozen_casts(weight_t, torch.bfloat16)))  # made once, kept
    want, want_grad = trained_twin()
    assert first.dtype == torch.bfloat16 and torch.equal(first, want) and torch.equal(again, want)
    first.float().sum().backward()
    assert torch.equal(x.grad, want_grad) and x.grad.abs().sum() > 0
    with torch.no_grad():
        weight_t.mul_(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        changed = L.linear(x, weight_t, None, None)
    assert torch.equal(changed, trained_twin()[0]) and not torch.equal(changed, first)


def test_a_frozen_weights_products_match_torch_and_follow_its_changes():
    """``frozen_products`` (a draft's loss through a target's head): the product and the input's gradient
    through a frozen weight equal torch's bf16 products of its casts to bf16 rounding (on a CPU with AMX
    tiles or AVX-512 BF16 they run on specjet's GEMM, packed once a weight version), and an in-place change of
    the weight is seen by the next call."""
    import torch

    from specjet.kernels import bf16_gemm
    from specjet.kernels.training_linear import frozen_casts, frozen_products

    gen = torch.Generator().manual_seed(1)
    weight_t = torch.randn(576, 8192, generator=gen) / 24  # a hot head's shape, frozen
    x = torch.randn(37, 576, generator=gen).bfloat16()
    g = torch.randn(37, 8192, generator=gen).bfloat16()

    def check():
        forward, backward = frozen_products(weight_t, torch.bfloat16)
        in_out, out_in = frozen_casts(weight_t, torch.bfloat16)
        y, gx = forward(x), backward(g)
        assert y.dtype == gx.dtype == torch.bfloat16 and y.shape == (37, 8192) and gx.shape == (37, 576)
        for got, a, b in ((y, x, in_out), (gx, g, out_in)):
            exact = a.double() @ b.double()
            scale = (a.double().abs() @ b.double().abs())
            assert ((got.double() - exact).abs() <= 2 ** -7 * scale + 1e-30).all()
        return forward, backward

    forward, backward = check()
    own = bf16_gemm.default_isa() != "onednn"
    assert isinstance(forward, bf16_gemm.Bf16Linear) == own and isinstance(backward, bf16_gemm.Bf16Linear) == own
    assert frozen_products(weight_t, torch.bfloat16)[0] is forward  # made (packed) once, kept
    before = forward(x)
    with torch.no_grad():
        weight_t.mul_(2)
    check()
    assert torch.equal(frozen_products(weight_t, torch.bfloat16)[0](x), before * 2)  # a power of two: exact
