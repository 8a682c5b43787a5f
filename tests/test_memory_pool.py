"""The KV allocator and request-to-token table: paging, freeing, snapshots, and the leak check."""
from __future__ import annotations

import pytest
import torch

from specjet.scheduler.memory_pool import (
    OutOfKVMemory,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    check_kv_invariant,
)


def grow(alloc, table, row, old, new):
    slots = alloc.extend(table[row], old, new)
    table[row, old:new] = slots
    return slots


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_fills_pages_then_frees_everything(page_size):
    alloc = TokenToKVPoolAllocator(64 * page_size, page_size, "cpu")
    pool = ReqToTokenPool(4, 256, "cpu")
    assert alloc.size == 63 * page_size
    row = pool.alloc()
    grow(alloc, pool.table, row, 0, 5)
    grow(alloc, pool.table, row, 5, 6)
    end = 3 * page_size + 7
    grow(alloc, pool.table, row, 6, end)
    slots = pool.table[row, :end]
    assert len(set(slots.tolist())) == len(slots)  # every position its own slot
    assert (slots >= page_size).all()  # never the padding page
    # positions inside one page share that page, in order
    pages = slots // page_size
    assert (slots % page_size == torch.arange(len(slots)) % page_size).all()
    assert (pages[: page_size] == pages[0]).all()
    check_kv_invariant(alloc, {"r": slots})
    alloc.free_request(pool.table[row], end)
    pool.free(row)
    check_kv_invariant(alloc, {})
    assert alloc.num_free_slots == alloc.size


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_growth_through_the_tables_numpy_view(page_size):
    """The scheduler's path (slots as a list, written through the CPU table's numpy view): the table holds
    them, a page's positions share it in order whatever step a growth starts at, no slot twice, never the
    padding page; more than the pool takes nothing."""
    steps = [0, 1, 2, 3, 7, 8, 9, 16, 17, 31, 33, 40]
    alloc = TokenToKVPoolAllocator(64 * page_size, page_size, "cpu")
    pool = ReqToTokenPool(1, 64, "cpu")
    row = pool.alloc()
    host_row = pool.host[row]
    for old, new in zip(steps, steps[1:]):
        host_row[old:new] = alloc.extend_list(int(host_row[old - 1]) if old else 0, old, new)
    slots = pool.table[row, :steps[-1]]
    assert slots.tolist() == host_row[:steps[-1]].tolist()
    assert len(set(slots.tolist())) == len(slots) and (slots >= page_size).all()
    assert (slots % page_size == torch.arange(len(slots)) % page_size).all()
    pages = (slots // page_size).view(-1, page_size) if steps[-1] % page_size == 0 else None
    if pages is not None:
        assert (pages == pages[:, :1]).all()  # each page's positions on one page
    check_kv_invariant(alloc, {"r": slots})
    free_before = alloc.free_page_ids()
    with pytest.raises(OutOfKVMemory):
        alloc.extend_list(int(host_row[steps[-1] - 1]), steps[-1], 64 * 64 * page_size)
    assert alloc.free_page_ids() == free_before


def test_slots_needed_counts_only_new_pages():
    alloc = TokenToKVPoolAllocator(16 * 8, 8, "cpu")
    assert alloc.slots_needed(0, 1) == 8
    assert alloc.slots_needed(1, 8) == 0
    assert alloc.slots_needed(8, 9) == 8
    assert alloc.slots_needed(5, 17) == 16


def test_out_of_memory_takes_nothing():
    alloc = TokenToKVPoolAllocator(8, 1, "cpu")  # 7 usable slots
    table = torch.zeros(1, 32, dtype=torch.int64)
    grow(alloc, table, 0, 0, 6)
    free_before = alloc.num_free_slots
    with pytest.raises(OutOfKVMemory):
        alloc.extend(table[0], 6, 9)
    assert alloc.num_free_slots == free_before


@pytest.mark.parametrize("page_size", [1, 16])
def test_snapshot_restore_releases_scratch_slots(page_size):
    alloc = TokenToKVPoolAllocator(64 * page_size, page_size, "cpu")
    table = torch.zeros(2, 64 * page_size, dtype=torch.int64)
    grow(alloc, table, 0, 0, 4)
    free_before = sorted(alloc.free_page_ids())
    snap = alloc.snapshot()
    for _ in range(3):  # scratch, e.g. a drafter's, taken over several steps
        alloc.extend(torch.empty(0, dtype=torch.int64), 0, 5 * page_size)
    assert alloc.num_free_slots < len(free_before) * page_size
    alloc.restore(snap)
    assert sorted(alloc.free_page_ids()) == free_before
    check_kv_invariant(alloc, {"r": table[0, :4]})


def test_invariant_catches_leak_and_double_ownership():
    alloc = TokenToKVPoolAllocator(16, 1, "cpu")
    table = torch.zeros(2, 16, dtype=torch.int64)
    grow(alloc, table, 0, 0, 3)
    with pytest.raises(AssertionError, match="leak"):
        check_kv_invariant(alloc, {})  # the request's slots are not accounted for
    with pytest.raises(AssertionError, match="owned by both"):
        check_kv_invariant(alloc, {"a": table[0, :3], "b": table[0, 1:2]})
    alloc.free_request(table[0], 3)
    alloc.free_request(table[0], 3)  # double free
    with pytest.raises(AssertionError):
        check_kv_invariant(alloc, {})


def test_req_to_token_rows_are_reused():
    pool = ReqToTokenPool(2, 8, "cpu")
    a, b = pool.alloc(), pool.alloc()
    assert {a, b} == {0, 1} and pool.alloc() is None
    pool.free(a)
    assert pool.alloc() == a


def test_the_default_pool_is_sized_from_available_memory_not_free_pages(tmp_path, monkeypatch):
    """The default KV pool takes mem_fraction_static of MemAvailable (free pages plus the page cache the kernel can
    drop): on a machine whose page cache has filled, free pages alone are a few hundred MB and sized the default
    engine's pool to a few hundred tokens (a 400-token reply aborted). Without /proc/meminfo, free pages."""
    from specjet.models import runner

    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 55_000}  # ~215 MB free: a filled page cache
    monkeypatch.setattr(runner.os, "sysconf", lambda name: pages[name])
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24730000 kB\nMemFree:          227000 kB\nMemAvailable:   21000000 kB\n")
    assert runner.available_host_memory_bytes(str(meminfo)) == 21000000 * 1024
    assert runner.available_host_memory_bytes(str(tmp_path / "absent")) == 4096 * 55_000
    meminfo.write_text("MemTotal: 1 kB\n")  # no MemAvailable line (a kernel before 3.14)
    assert runner.available_host_memory_bytes(str(meminfo)) == 4096 * 55_000
