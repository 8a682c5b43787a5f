"""The bf16dp attention's tiles by FMAs (csrc/attention_body.h tile_products_by_fma): a tile of 8+ rows may compute
each VDPBF16PS as two fused multiply-adds on the words' float32 halves (Intel's default, where the instruction issues
at half the FMAs' multiply-add rate). That must give the instruction's bits exactly: subnormals as zero included, a
lone last key's partner, key chunks, trees whose nodes see scattered ancestors, and the decode rows that stay with the
instruction."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specjet.kernels import attention as A
from specjet.kernels import cpu_ops
from specjet.kernels.attention_metadata import build_attention_metadata
from test_cpu_ops import runs, scattered_table, tree_mask

pytestmark = pytest.mark.skipif(not runs("bf16dp"), reason="this CPU does not run the bf16dp build (AVX-512 BF16)")

HEADS, KV_HEADS = 9, 3


def attend(q, k, v, table, kv_lens, q_lens, mask=None):
    meta = build_attention_metadata(table, torch.arange(len(kv_lens)), torch.tensor(kv_lens), torch.tensor(q_lens),
                                    mask)
    cm = None if meta.custom_mask is None else meta.custom_mask.contiguous()
    out = cpu_ops.extension().paged_attention(q, k, v, meta.kv_indices.contiguous(), meta.kv_lens, meta.q_lens,
                                              meta.q_starts, cm, 0.125, cpu_ops.ISAS["bf16dp"])
    return out, meta


def fma_allowed() -> bool:
    """Whether this CPU's VDPBF16PS passed the load-time check that two FMAs give its bits (fma_matches_dpbf16)."""
    ext = cpu_ops.extension()
    before = ext.bf16dp_tile_products()
    try:
        ext.bf16dp_tile_products(1)
    except RuntimeError:
        return False
    ext.bf16dp_tile_products(before)
    return True


@pytest.fixture
def set_mode():
    """Sets the tiles' products for a test (0 VDPBF16PS, 1 FMAs), and puts the process's choice back after it."""
    if not fma_allowed():
        pytest.skip("on this CPU two FMAs do not give VDPBF16PS's bits: the tiles keep the instruction")
    ext = cpu_ops.extension()
    before = ext.bf16dp_tile_products()
    yield ext.bf16dp_tile_products
    ext.bf16dp_tile_products(before)


def bf16_values(shape, gen, scale: float) -> torch.Tensor:
    """Random bf16 values times `scale`: at 1e-36 most are subnormal or flush to zero in the products."""
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("scale", [1.0, 1e-19, 1e-36])
def test_tiles_by_fma_give_the_instructions_bits(set_mode, dim, scale):
    """16-node trees over 300, 301 (a lone last key in the pairs) and 600 keys (two chunks), keys in scattered slots,
    two requests batched: every output bit the same whether a tile's products take VDPBF16PS or FMAs."""
    gen = torch.Generator().manual_seed(dim)
    nodes = 16
    for prefix, batch in ((300, 1), (301, 2), (600, 1)):
        n = prefix + nodes
        k = bf16_values((batch * n + 1, KV_HEADS, dim), gen, scale)
        v = bf16_values((batch * n + 1, KV_HEADS, dim), gen, scale)
        q = torch.randn(batch * nodes, HEADS, dim, generator=gen) * (scale if scale < 1e-30 else 1.0)
        mask = tree_mask(batch, nodes, gen)
        table = scattered_table([n] * batch, gen)
        set_mode(0)
        by_instruction, meta = attend(q, k, v, table, [n] * batch, [nodes] * batch, mask)
        set_mode(1)
        by_fma, _ = attend(q, k, v, table, [n] * batch, [nodes] * batch, mask)
        assert torch.equal(by_fma, by_instruction), (prefix, batch)
        if scale == 1.0:  # and the values are the attention's (bf16's own rounding of q and the weights)
            torch.testing.assert_close(by_fma, A._attention_float64(q, k, v, meta, 0.125).float(), rtol=1e-2, atol=1e-2)


def test_a_tile_by_fma_gives_each_node_its_decode_steps_bits(set_mode):
    """With the tiles' products by FMAs, each node of a tree gets the bits of the same token decoded alone after its
    ancestors (a decode step's 3 rows a KV head take VDPBF16PS), on one thread and on three."""
    set_mode(1)
    gen = torch.Generator().manual_seed(5)
    nodes, prefix, dim = 16, 333, 64
    n = prefix + nodes
    k, v = bf16_values((n + 1, KV_HEADS, dim), gen, 1.0), bf16_values((n + 1, KV_HEADS, dim), gen, 1.0)
    q = torch.randn(nodes, HEADS, dim, generator=gen)
    mask = tree_mask(1, nodes, gen)
    out, _ = attend(q, k, v, torch.arange(1, n + 1).view(1, n), [n], [nodes], mask)
    for i in range(nodes):
        seen = list(range(1, prefix + 1)) + [prefix + 1 + j for j in range(nodes) if mask[0, i, j]]
        alone, _ = attend(q[i:i + 1].contiguous(), k, v, torch.tensor([seen]), [len(seen)], [1])
        assert torch.equal(alone[0], out[i]), i
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(attend(q, k, v, torch.arange(1, n + 1).view(1, n), [n], [nodes], mask)[0], out)
    finally:
        torch.set_num_threads(threads)


def test_the_tiles_products_are_chosen_by_the_cpu_or_the_environment():
    """Intel's cores take the FMAs by default where the load-time check passes, others the instruction;
    SPECJET_BF16DP_TILE_PRODUCTS forces one (fma only where the check passes), and a name it does not know is refused
    with the variable's name; the setter takes -1 (ask), 0 or 1."""
    def chosen(value: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "SPECJET_BF16DP_TILE_PRODUCTS"}
        if value is not None:
            env["SPECJET_BF16DP_TILE_PRODUCTS"] = value
        code = ("from specjet.kernels import cpu_ops; ext = cpu_ops.extension(); "
                "ext.isa_supported(cpu_ops.ISAS['bf16dp']); print(ext.bf16dp_tile_products())")
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    intel, allowed = "GenuineIntel" in open("/proc/cpuinfo").read(), fma_allowed()
    assert chosen(None).stdout.strip() == ("1" if intel and allowed else "0")
    if allowed:
        assert chosen("fma").stdout.strip() == "1"
    else:
        assert "do not give VDPBF16PS's bits" in chosen("fma").stderr
    assert chosen("dpbf16").stdout.strip() == "0"
    bad = chosen("fast")
    assert bad.returncode != 0 and "SPECJET_BF16DP_TILE_PRODUCTS=fast" in bad.stderr
    with pytest.raises(RuntimeError, match="mode -1"):
        cpu_ops.extension().bf16dp_tile_products(2)
