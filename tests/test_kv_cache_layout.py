"""The KV pool's memory layout (models/kv_cache.py): head-major on the CPU, seen as [layers, slots, H_kv, D].

The kernels' bits do not depend on the layout (tests/test_cpu_ops.py); this checks the pool itself: a KV
head's keys lie side by side in slot order, and the torch-side writes and moves land where the
[slots, H_kv, D] view says.
"""
from __future__ import annotations

import pytest
import torch

from bench.soak import rss_mb
from specjet.models.kv_cache import KVCache


def test_a_cpu_pool_keeps_a_heads_keys_side_by_side_and_writes_through_its_view():
    layers, slots, kv_heads, dim = 2, 10, 3, 8
    cache = KVCache(layers, slots, kv_heads, dim, torch.float32, "cpu")
    assert cache.k.shape == cache.v.shape == (layers, slots, kv_heads, dim)
    assert cache.k[1].stride() == (dim, slots * dim, 1), "slot s + 1 of a head follows slot s in memory"
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, kv_heads, dim, generator=gen), torch.randn(3, kv_heads, dim, generator=gen)
    where = torch.tensor([7, 2, 5])
    cache.write(1, where, k, v)
    assert torch.equal(cache.k[1, where], k) and torch.equal(cache.v[1, where], v)
    # The memory itself: head h of slot s starts h * slots * dim + s * dim elements into the layer.
    assert cache.k[1, 7, 2].data_ptr() - cache.k[1].data_ptr() == (2 * slots + 7) * dim * 4
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[where] = False
    assert not cache.k[:, untouched].any() and not cache.k[0].any()

    cache.move_slots(torch.tensor([7, 5]), torch.tensor([1, 3]))
    assert torch.equal(cache.k[1, torch.tensor([1, 3])], k[torch.tensor([0, 2])])
    assert torch.equal(cache.v[1, torch.tensor([1, 3])], v[torch.tensor([0, 2])])
    assert KVCache.bytes_per_token(layers, kv_heads, dim, torch.float32) == 2 * layers * kv_heads * dim * 4


@pytest.mark.skipif(rss_mb() is None, reason="reads the process's resident size in /proc")
def test_a_cpu_pool_takes_memory_as_requests_fill_it():
    """The pool is sized for the engine's whole token budget, most of which an agent's few requests never reach: its
    pages become resident as they are written (a pool of ~1.1 GB costs a few MB until then), and read as zeros."""
    layers, slots, kv_heads, dim = 30, 50_000, 3, 64
    pool_mb = 2 * layers * slots * kv_heads * dim * 2 / 2**20  # ~1.1 GB
    before = rss_mb()
    cache = KVCache(layers, slots, kv_heads, dim, torch.bfloat16, "cpu")
    assert rss_mb() - before < pool_mb / 8  # (torch.zeros: the whole pool)
    assert cache.k.shape == (layers, slots, kv_heads, dim) and cache.k.data_ptr() % 4096 == 0
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, kv_heads, dim, generator=gen), torch.randn(2, kv_heads, dim, generator=gen)
    where = torch.tensor([1, 40_000])
    for layer in range(layers):
        cache.write(layer, where, k, v)
    assert torch.equal(cache.k[29, where], k.to(torch.bfloat16)) and torch.equal(cache.v[0, where], v.to(torch.bfloat16))
    assert not cache.k[:, 2:1000].any() and not cache.v[7, 40_001:].any()
    assert rss_mb() - before < pool_mb / 8  # two slots in every layer and head: a page or two each
