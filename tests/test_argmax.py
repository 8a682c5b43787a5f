"""kernels/argmax.py: ``argmax_rows`` gives torch.argmax's ids (the first maximal value, the first NaN where
a row holds one) through the C++ pass, on every shape and value it may meet, and falls back to torch where
that pass does not serve."""
from __future__ import annotations

import pytest
import torch

from specjet.kernels import cpu_ops
from specjet.kernels.argmax import argmax_rows

needs_ext = pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ extension is not built")


@needs_ext
@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("cols", [1, 5, 63, 64, 65, 1000, 49152])
def test_random_rows_with_ties_equal_torch(rows, cols):
    """Rounded values (ties within and across 64-column blocks), so the first maximum must win; 70 rows of
    49,152 columns split between the threads."""
    gen = torch.Generator().manual_seed(rows * 100_000 + cols)
    logits = (torch.randn(rows, cols, generator=gen) * 2).round()
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))


@needs_ext
def test_special_values_follow_torchs_rule():
    cols = 300
    logits = torch.randn(10, cols, generator=torch.Generator().manual_seed(1))
    logits[0, 0] = float("nan")  # a NaN in the first column
    logits[1, 200] = float("nan")  # a NaN after larger values
    logits[1, 5] = 1e30
    logits[2, 70] = logits[2, 250] = float("nan")  # two NaNs: the first
    logits[3, 130] = float("inf")
    logits[4] = float("-inf")  # nothing but -inf: column 0
    logits[5] = float("-inf")
    logits[5, 299] = -1e38  # the last column the only finite value
    logits[6] = 3.0  # all equal
    logits[7, 64] = logits[7, 128] = 1e9  # a tie at blocks' first columns
    logits[8, 10] = float("inf")
    logits[8, 290] = float("nan")  # an infinity before a NaN: the NaN
    logits[9, 299] = 1e9  # the maximum in the last, partial block
    expected = logits.argmax(-1)
    assert expected.tolist()[:9] == [0, 200, 70, 130, 0, 299, 0, 64, 290]
    assert torch.equal(argmax_rows(logits), expected)


@needs_ext
def test_a_strided_view_reads_its_own_rows():
    base = torch.randn(6, 2 * 500, generator=torch.Generator().manual_seed(2))
    view = base[::2, ::2]  # neither rows nor columns contiguous
    assert torch.equal(argmax_rows(view), view.argmax(-1))
    assert torch.equal(argmax_rows(base[1:4, 100:300]), base[1:4, 100:300].argmax(-1))


def test_what_the_cpp_pass_does_not_serve_goes_to_torch():
    """bf16 logits, a tensor that needs a gradient, one dimension or three, no columns: torch's argmax (and
    its error)."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    assert torch.equal(argmax_rows(logits.bfloat16()), logits.bfloat16().argmax(-1))
    grad = logits.clone().requires_grad_()
    assert torch.equal(argmax_rows(grad), logits.argmax(-1))
    assert torch.equal(argmax_rows(logits[0]), logits[0].argmax(-1))
    three = logits.view(2, 2, 100)
    assert torch.equal(argmax_rows(three), three.argmax(-1))
    with pytest.raises((RuntimeError, IndexError)):
        argmax_rows(torch.empty(3, 0))


@needs_ext
def test_the_extension_refuses_what_it_cannot_read():
    ext = cpu_ops.extension()
    with pytest.raises(RuntimeError, match="float32"):
        ext.argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float32"):
        ext.argmax_rows(torch.zeros(8))
    with pytest.raises(RuntimeError, match="no columns"):
        ext.argmax_rows(torch.zeros(2, 0))
