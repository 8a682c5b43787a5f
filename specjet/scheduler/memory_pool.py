"""KV memory bookkeeping: which request position lives in which KV slot, and which slots are free.

`ReqToTokenPool` gives each live request a row mapping its token positions to KV slots.
`TokenToKVPoolAllocator` hands out slots a page at a time. Page 0 is reserved as the padding page
(padded batch positions point at slot 0), so the pool's usable size is ``(num_pages - 1) * page_size``.

Per request the scheduler tracks ``kv_committed_len`` (positions whose KV is valid and accepted) and
``kv_allocated_len`` (positions with a slot reserved, including speculative room); slots beyond the
committed length are released when the request finishes.
"""
from __future__ import annotations

import threading
import torch


class ReqToTokenPool:
    def __init__(self, num_rows: int, max_context_len: int, device):
        self.table = torch.zeros((num_rows, max_context_len), dtype=torch.int64, device=device)
        # The host's view of a CPU table (the same memory): a few entries written or read through numpy
        # cost a fraction of a torch op. None on other devices.
        self.host = self.table.numpy() if self.table.device.type == "cpu" else None
        self.max_context_len = max_context_len
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.num_rows = num_rows

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    @property
    def available(self) -> int:
        return len(self._free_rows)


class OutOfKVMemory(RuntimeError):
    pass


class TokenToKVPoolAllocator:
    def __init__(self, num_slots: int, page_size: int, device):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 2 * page_size:
            raise ValueError(f"a KV pool of {num_slots} slots is too small for page_size {page_size}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        self.device = device
        # Pages 1..num_pages-1 are free; page 0 is the padding page. Popping from the end hands out
        # low pages first, which keeps tests' slot numbers readable.
        self._free_pages: list[int] = list(range(self.num_pages - 1, 0, -1))
        # Pages taken while a snapshot is open, so restoring costs what drafting took, not a copy
        # of the whole free list (which can hold millions of pages).
        self._taken_log: list[int] = []
        self._open_snapshots = 0
        # The overlap loop's host thread reserves and frees while the compute thread drafts with
        # scratch pages; the lock is held from snapshot to restore so that restoring gives back the
        # drafter's pages only, and every other change of the free list takes it too.
        self._lock = threading.RLock()

    @property
    def size(self) -> int:
        """Slots that can ever be handed out (the padding page excluded)."""
        return (self.num_pages - 1) * self.page_size

    @property
    def num_free_slots(self) -> int:
        with self._lock:
            return len(self._free_pages) * self.page_size

    def slots_needed(self, allocated_len: int, new_len: int) -> int:
        """Slots a request must take from the pool to grow from ``allocated_len`` to ``new_len`` positions."""
        p = self.page_size
        return max(0, -(-new_len // p) - -(-allocated_len // p)) * p

    def extend(self, row_slots: torch.Tensor, allocated_len: int, new_len: int) -> torch.Tensor:
        """Slots for positions [allocated_len, new_len) of a request whose row is ``row_slots``, as a tensor
        on the pool's device (``extend_list``'s slots)."""
        last_slot = int(row_slots[allocated_len - 1]) if 0 < allocated_len and allocated_len % self.page_size else 0
        return torch.tensor(self.extend_list(last_slot, allocated_len, new_len), dtype=torch.int64,
                            device=self.device)

    def extend_list(self, last_slot: int, allocated_len: int, new_len: int) -> list[int]:
        """Slots for positions [allocated_len, new_len) of a request: positions first fill the rest of the
        request's last page (the page of ``last_slot``, the slot of position ``allocated_len - 1``; unread
        when that page is full), then take whole new pages. Raises OutOfKVMemory (and takes nothing) when
        the pool cannot cover it. Plain Python: a decode step's few positions cost less than torch ops."""
        p = self.page_size
        first_new_page = -(-allocated_len // p)
        with self._lock:
            pages = self._take_pages(-(-new_len // p) - first_new_page)
        last_page = last_slot // p
        return [(last_page if pos // p < first_new_page else pages[pos // p - first_new_page]) * p + pos % p
                for pos in range(allocated_len, new_len)]

    def _take_pages(self, count: int) -> list[int]:
        """``count`` pages off the free list (the lock held), or OutOfKVMemory taking none."""
        if count > len(self._free_pages):
            raise OutOfKVMemory(f"need {count} pages, {len(self._free_pages)} free")
        pages = [self._free_pages.pop() for _ in range(count)]
        if self._open_snapshots:
            self._taken_log.extend(pages)
        return pages

    def free_request(self, row_slots: torch.Tensor, allocated_len: int, start: int = 0) -> None:
        """Release every page that positions [start, allocated_len) of a request occupy (``start``
        page-aligned: the positions before it are not the request's to free, e.g. cached ones)."""
        if allocated_len > start:
            self.free_slots(row_slots[start:allocated_len])

    def free_slots(self, slots: torch.Tensor) -> None:
        """Release the pages of ``slots``, the slots of consecutive positions starting at a page
        boundary (a request's row, or a cached prefix's)."""
        if len(slots) == 0:
            return
        # Positions 0, p, 2p, ... each start a page; one slot per page identifies it.
        pages = (slots[::self.page_size] // self.page_size).tolist()
        with self._lock:
            self._free_pages.extend(reversed(pages))

    def snapshot(self) -> int:
        """Mark the free list; ``restore(mark)`` gives back every page taken since (a drafter's
        scratch). Pages taken after a snapshot must not be freed before the restore. Other threads
        wait from snapshot to restore, which must happen on the same thread."""
        self._lock.acquire()
        self._open_snapshots += 1
        return len(self._taken_log)

    def restore(self, mark: int) -> None:
        try:
            taken = self._taken_log[mark:]
            del self._taken_log[mark:]
            self._free_pages.extend(reversed(taken))
            self._open_snapshots -= 1
        finally:
            self._lock.release()

    def free_page_ids(self) -> list[int]:
        with self._lock:
            return list(self._free_pages)


def check_kv_invariant(allocator: TokenToKVPoolAllocator, owned_slots_by_request: dict[object, torch.Tensor]) -> None:
    """free + owned == pool size, no page owned twice, no page both owned and free.

    ``owned_slots_by_request`` maps a request id to the slots of positions [0, kv_allocated_len).
    Raises AssertionError naming the problem.
    """
    p = allocator.page_size
    free = allocator.free_page_ids()
    if len(set(free)) != len(free):
        raise AssertionError("a page appears twice in the free list")
    if 0 in free:
        raise AssertionError("the padding page 0 is in the free list")
    owned: dict[int, object] = {}
    for rid, slots in owned_slots_by_request.items():
        for page in set((slots // p).tolist()):
            if page in owned:
                raise AssertionError(f"page {page} owned by both {owned[page]!r} and {rid!r}")
            if page == 0:
                raise AssertionError(f"request {rid!r} owns the padding page")
            owned[page] = rid
    both = set(owned) & set(free)
    if both:
        raise AssertionError(f"pages both free and owned: {sorted(both)[:5]}")
    total = len(free) + len(owned)
    if total != allocator.num_pages - 1:
        raise AssertionError(
            f"KV leak: {len(free)} free + {len(owned)} owned pages != {allocator.num_pages - 1} in the pool"
        )
