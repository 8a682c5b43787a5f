"""The order in which VDPBF16PS adds a word's two products, which the bf16dp attention's invariance rests on
(csrc/dpbf16_order.h): the instruction against Intel's definition written here, the extension's own check agreeing
with it, and the attention build chosen from that check."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specjet.kernels import cpu_ops

ext = cpu_ops.extension()
pytestmark = pytest.mark.skipif(ext is None or not ext.bf16_gemm_isa_supported(1),
                                reason="needs the C++ ops on a CPU with AVX-512 BF16")

T = 2.0 ** -12
# (acc, hi_a, hi_b, lo_a, lo_b) lanes whose result tells the orders apart: two products of 2^-24 on 1 (in order each
# rounds away; summed first they make an ulp), 2^-24 and -1 on 1, the same with the halves swapped, 1.5 x 2^-24 on 1
# (rounded to nearest: up; cut: down).
TELLING = [(1.0, T, T, T, T), (1.0, T, T, -1.0, 1.0), (1.0, -1.0, 1.0, T, T), (1.0, 3 * 2.0 ** -13, T, 0.0, 0.0)]


def f32(x):
    return np.float32(x)


def odd_first(acc, ha, hb, la, lb):
    """Intel's definition: acc + the odd (high) half's product, rounded; + the even half's, rounded (bf16 products
    are exact in float32)."""
    return f32(f32(f32(acc) + f32(f32(ha) * f32(hb))) + f32(f32(la) * f32(lb)))


def even_first(acc, ha, hb, la, lb):
    return odd_first(acc, la, lb, ha, hb)


def pair_first(acc, ha, hb, la, lb):
    """The pair's sum exact, then one rounding onto the accumulator (float64 holds these lanes' sums exactly)."""
    return f32(np.float64(acc) + np.float64(ha) * hb + np.float64(la) * lb)


def lanes(rows: list[tuple]) -> list[torch.Tensor]:
    pad = (-len(rows)) % 16
    rows = rows + [(0.0, 0.0, 0.0, 0.0, 0.0)] * pad
    return [torch.tensor(col, dtype=torch.float32) for col in zip(*rows)]


def random_rows(n: int, seed: int = 0) -> list[tuple]:
    """Normal bf16 factors (float32 with the low 16 bits cleared) and float32 accumulators."""
    rng = np.random.default_rng(seed)

    def bf16(size):
        x = (rng.standard_normal(size) * 2.0 ** rng.integers(-6, 7, size)).astype(np.float32)
        return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)

    acc = (rng.standard_normal(n) * 4).astype(np.float32)
    return list(zip(acc.tolist(), *(bf16(n).tolist() for _ in range(4))))


def test_the_telling_lanes_tell_the_orders_apart():
    """The lanes the check uses give another float under each other order (so a CPU that adds otherwise fails it)."""
    for other in (even_first, pair_first):
        assert any(odd_first(*row) != other(*row) for row in TELLING), other.__name__


def test_the_extensions_check_agrees_with_the_instruction_against_the_definition():
    """On this CPU: the instruction's results, bit for bit, against the definition on the telling lanes and on 4,096
    random ones; the extension runs the bf16dp build exactly where they match (on this project's CPUs: everywhere)."""
    rows = TELLING + random_rows(4096)
    got = ext.dpbf16_words(*lanes(rows))[:len(rows)].numpy()
    want = np.array([odd_first(*row) for row in rows], dtype=np.float32)
    matches = bool((got.view(np.uint32) == want.view(np.uint32)).all())
    assert ext.isa_supported(cpu_ops.ISAS["bf16dp"]) == matches


def test_the_words_check_their_arguments():
    a = torch.zeros(16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.dpbf16_words(torch.zeros(15), *[torch.zeros(15)] * 4)
    with pytest.raises(RuntimeError, match="float32"):
        ext.dpbf16_words(a.double(), a, a, a, a)


class _OtherOrder:
    """The extension on a CPU whose VDPBF16PS fails the check: AVX-512 BF16 present, the bf16dp build refused."""

    def __getattr__(self, name):
        return getattr(ext, name)

    def isa_supported(self, code):
        return code != cpu_ops.ISAS["bf16dp"] and ext.isa_supported(code)


def test_a_cpu_whose_instruction_adds_otherwise_gets_the_lanes(monkeypatch):
    """The default is then the avx512 lanes (their own invariance, no pairing), the start-up log says so, and asking
    for bf16dp by name is an error that says why."""
    monkeypatch.setattr(cpu_ops, "extension", lambda: _OtherOrder())
    monkeypatch.delenv(cpu_ops.ISA_ENV, raising=False)
    try:
        cpu_ops.isa.cache_clear()
        assert cpu_ops.isa() == cpu_ops.ISAS["avx512"]
        assert cpu_ops.describe_attention(torch.bfloat16, 64) == "attention: avx512 build (auto), float32 lanes"
        monkeypatch.setenv(cpu_ops.ISA_ENV, "bf16dp")
        cpu_ops.isa.cache_clear()
        with pytest.raises(ValueError, match="does not add a word's two products in the order"):
            cpu_ops.isa()
    finally:
        monkeypatch.delenv(cpu_ops.ISA_ENV, raising=False)
        cpu_ops.isa.cache_clear()
