"""The radix prefix cache on its own: matching, splitting, insertion of what the tree lacks, locks,
LRU eviction of unlocked leaves only, page alignment, and its consistency check; and the
scheduler's chunked-prefill policy (a long prompt's chunks alternate with the running requests'
decode steps), driven through the real Scheduler with tokens handed back by the test."""
from __future__ import annotations

import pytest
import torch

from specjet.scheduler.batch import BatchKind
from specjet.scheduler.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator, check_kv_invariant
from specjet.scheduler.radix_cache import RadixCache
from specjet.scheduler.request import Req
from specjet.scheduler.sampling_params import SamplingParams
from specjet.scheduler.scheduler import Scheduler, SchedulerConfig


def computed(alloc, n):
    """Slots for n positions of a fresh request (what a prefill would have written)."""
    return alloc.extend(torch.empty(0, dtype=torch.int64), 0, n) if alloc.page_size == 1 else \
        _paged(alloc, n)


def _paged(alloc, n):
    row = torch.zeros(n, dtype=torch.int64)
    row[:] = alloc.extend(row, 0, n)
    return row


def invariant(alloc, cache, held=(), requests=None):
    cache.check(list(held))
    owned = dict(cache.owned_slots())
    owned.update(requests or {})
    check_kv_invariant(alloc, owned)


def test_match_insert_split_and_duplicates():
    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    cache = RadixCache(alloc)
    a = [1, 2, 3, 4, 5, 6]
    slots_a = computed(alloc, 6)
    existing, node_a = cache.insert(a, slots_a)
    assert existing == 0 and cache.cached_tokens == 6
    m = cache.match_prefix([1, 2, 3, 9, 9])
    assert m.length == 3 and m.slots.tolist() == slots_a[:3].tolist()
    assert m.node.depth == 3  # the node was split where the match ended
    # b shares 3 tokens: the tree keeps its own slots for them, the caller frees its duplicates
    b = [1, 2, 3, 7, 8]
    slots_b = computed(alloc, 5)
    existing, node_b = cache.insert(b, slots_b)
    assert existing == 3 and node_b.depth == 5
    alloc.free_slots(slots_b[:3])
    assert cache.match_prefix(b).slots.tolist() == slots_a[:3].tolist() + slots_b[3:].tolist()
    assert cache.match_prefix(a).slots.tolist() == slots_a.tolist()
    assert cache.cached_tokens == 8
    invariant(alloc, cache)


def test_locked_nodes_survive_eviction_and_lru_goes_first():
    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    cache = RadixCache(alloc)
    for first in (10, 20, 30):  # three unrelated prompts, inserted oldest first
        cache.insert([first, first + 1, first + 2], computed(alloc, 3))
    held = cache.match_prefix([10, 11, 12]).node  # the oldest, but a request holds it
    cache.lock(held)
    cache.match_prefix([30, 31, 32])  # touch the newest: 20.. is now the least recently used
    free = alloc.num_free_slots
    assert cache.evict(1) == 3
    assert alloc.num_free_slots == free + 3
    assert cache.match_prefix([20, 21, 22]).length == 0
    assert cache.match_prefix([30, 31, 32]).length == 3
    assert cache.evict(100) == 3  # everything unlocked goes, the held node stays
    assert cache.match_prefix([10, 11, 12]).length == 3
    invariant(alloc, cache, held=[held])
    cache.unlock(held)
    assert cache.flush() == 3 and cache.cached_tokens == 0
    assert alloc.num_free_slots == alloc.size
    invariant(alloc, cache)


def test_evicting_a_leaf_exposes_its_parent():
    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    cache = RadixCache(alloc)
    slots = computed(alloc, 4)
    cache.insert([1, 2, 3, 4], slots)
    other = computed(alloc, 4)
    cache.insert([1, 2, 5, 6], other)
    alloc.free_slots(other[:2])
    assert cache.evict(5) >= 5  # both leaves, then the shared parent [1, 2]
    assert cache.cached_tokens == 0 and alloc.num_free_slots == alloc.size
    invariant(alloc, cache)


def test_page_aligned_matching():
    alloc = TokenToKVPoolAllocator(64 * 4, 4, "cpu")
    cache = RadixCache(alloc)
    tokens = list(range(100, 112))  # three pages
    slots = computed(alloc, 12)
    cache.insert(tokens, slots)
    assert cache.match_prefix(tokens[:11]).length == 8  # a partial page never matches
    assert cache.match_prefix(tokens[:6] + [0, 0]).length == 4  # nor a page that differs anywhere
    with pytest.raises(ValueError, match="page-aligned"):
        cache.insert(tokens[:6], slots[:6])
    assert cache.match_prefix(tokens).slots.tolist() == slots.tolist()
    invariant(alloc, cache)


def test_check_catches_a_wrong_lock_count():
    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    cache = RadixCache(alloc)
    _, node = cache.insert([1, 2, 3], computed(alloc, 3))
    cache.lock(node)
    with pytest.raises(AssertionError, match="lock count"):
        cache.check([])  # a lock no live request accounts for (a leak of the lock)
    cache.check([node])


# ---------------------------------------------------------------- the scheduler's chunk policy
@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture
def scheduler(tokenizer):
    def make(chunk, budget=1000, pool=4096):
        alloc = TokenToKVPoolAllocator(pool, 1, "cpu")
        rows = ReqToTokenPool(8, 1024, "cpu")
        config = SchedulerConfig(max_prefill_tokens=budget, chunked_prefill_size=chunk, context_len=1024)
        return Scheduler(tokenizer, None, config, alloc, rows, vocab_size=1000, eos_token_ids=[0])
    return make


def run_one(sched):
    """Launch and complete the next batch, each request getting token 7; returns (kind, rids, ends)."""
    batch = sched.next_batch()
    if batch is None:
        return None
    sched.start_batch(batch)
    sched.batch_done(batch, [[7] for _ in batch.reqs], None)
    return batch.kind, [r.rid for r in batch.reqs], list(batch.prefill_ends)


def submit(sched, rid, n, new_tokens, first=1, ids=None):
    req = Req(rid, list(range(first, first + n)) if ids is None else ids, SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}))
    sched.submit([req])
    sched.drain_inbox(block=False)
    return req


def test_a_submitted_list_reaches_the_loop_whole(scheduler, monkeypatch):
    """The loop may drain its inbox while another thread is inside ``submit``: it must find a generate()
    call's requests all there or none, so they start in one prefill batch."""
    sched = scheduler(chunk=64)
    reqs = [Req(f"r{i}", list(range(10 * i + 1, 10 * i + 6)), SamplingParams.from_dict(
        {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True})) for i in range(3)]
    seen = []
    real = sched.inbox

    class DrainedAfterEveryPut:  # the loop drains right after every item that lands
        get, get_nowait = real.get, real.get_nowait

        def put(self, item):
            real.put(item)
            sched.drain_inbox(block=False)
            seen.append([r.rid for r in sched.waiting])

    monkeypatch.setattr(sched, "inbox", DrainedAfterEveryPut())
    sched.submit(reqs)
    assert seen == [["r0", "r1", "r2"]]
    assert run_one(sched) == (BatchKind.PREFILL, ["r0", "r1", "r2"], [5, 5, 5])
    while run_one(sched) is not None:
        pass
    assert all(r.finished for r in reqs)
    sched.check_kv_invariant()


def test_long_prompt_chunks_alternate_with_decode_steps(scheduler):
    sched = scheduler(chunk=32)
    short = submit(sched, "short", 5, 50, first=500)
    assert run_one(sched) == (BatchKind.PREFILL, ["short"], [5])
    long = submit(sched, "long", 100, 3)
    steps = []
    while not long.finished:
        steps.append(run_one(sched))
    kinds = [(kind, rids) for kind, rids, _ in steps]
    # chunks of 32, 32, 32 and the last 4, a decode step of the short request after each
    assert [ends for kind, _, ends in steps if kind is BatchKind.PREFILL] == [[32], [64], [96], [100]]
    assert kinds[:7] == [(BatchKind.PREFILL, ["long"]), (BatchKind.DECODE, ["short"])] * 3 + [(BatchKind.PREFILL, ["long"])]
    assert kinds[7] == (BatchKind.DECODE, ["short", "long"])  # after its last chunk it decodes with the others
    assert len(long.output_ids) == 3 and short.output_ids
    sched.check_kv_invariant()


def test_prompt_longer_than_the_prefill_budget_is_chunked_by_the_budget(scheduler):
    sched = scheduler(chunk=64, budget=40)
    req = submit(sched, "r", 90, 1)
    ends = []
    while not req.finished:
        kind, _, e = run_one(sched)
        ends += e
    assert ends == [40, 80, 90]
    sched.check_kv_invariant()


def test_without_chunking_a_long_prompt_goes_whole(scheduler):
    sched = scheduler(chunk=None, budget=40)
    req = submit(sched, "r", 90, 1)
    assert run_one(sched) == (BatchKind.PREFILL, ["r"], [90])
    assert req.finished
    sched.check_kv_invariant()


def test_second_request_shares_the_first_ones_prompt_after_its_prefill(scheduler):
    sched = scheduler(chunk=None)
    first = submit(sched, "a", 50, 20)
    run_one(sched)  # a's prefill: its prompt goes into the cache
    second = submit(sched, "b", 50, 20)
    kind, rids, ends = run_one(sched)
    assert (kind, rids) == (BatchKind.PREFILL, ["b"])
    assert second.cached_tokens == 49  # all but the last token, whose logits start the output
    table = sched.req_to_token_pool.table
    assert table[second.req_pool_idx, :49].tolist() == table[first.req_pool_idx, :49].tolist()
    sched.check_kv_invariant()
    while sched.has_work():
        run_one(sched)
    sched.check_kv_invariant()
    assert sched.cache_info()["hit_tokens"] == 49


def test_next_token_len_stops_before_a_position_made_with_another_next_token():
    """EAGLE's draft KV at a position reads the token after it: a node's last position holds the
    draft KV its own request made, so a path that goes on with another token (here at 4, where
    the second request's own copy of position 3 was a duplicate and was freed) ends the usable
    part one position before."""
    alloc = TokenToKVPoolAllocator(64, 1, "cpu")
    cache = RadixCache(alloc)
    cache.insert([1, 2, 3, 4, 5, 6], computed(alloc, 6), next_token=7)
    other = computed(alloc, 8)
    existing, _ = cache.insert([1, 2, 3, 4, 9, 9, 9, 9], other, next_token=5)
    alloc.free_slots(other[:existing])
    assert existing == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).next_token_len == 6  # the first request's own path
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 0]).next_token_len == 5  # goes on otherwise after 6
    assert cache.match_prefix([1, 2, 3, 4, 9, 9, 9, 9, 5]).next_token_len == 3  # through the split at 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).next_token_len == 5  # nothing follows: unknown
    invariant(alloc, cache)


def test_requests_sharing_a_prefix_with_one_being_prefilled_wait_for_it_and_share_its_slots(scheduler):
    """Three requests arriving together with one 60-token prefix: the first is prefilled alone; the
    two others wait one batch and then take the prefix from the cache (one copy of its KV for all
    three). A request that shares only a short prefix is not held back."""
    sched = scheduler(chunk=None)
    prefix = list(range(1, 61))
    a = submit(sched, "a", 0, 5, ids=prefix + list(range(700, 710)))
    b = submit(sched, "b", 0, 5, ids=prefix + list(range(800, 810)))
    c = submit(sched, "c", 0, 5, ids=prefix + list(range(900, 906)))
    other = submit(sched, "other", 0, 5, ids=prefix[:10] + list(range(300, 330)))  # 10 shared: no reason to wait
    kind, rids, _ = run_one(sched)
    assert (kind, rids) == (BatchKind.PREFILL, ["a", "other"])
    kind, rids, _ = run_one(sched)
    assert (kind, rids) == (BatchKind.PREFILL, ["b", "c"])
    assert b.cached_tokens == c.cached_tokens == 60
    table = sched.req_to_token_pool.table
    assert table[b.req_pool_idx, :60].tolist() == table[a.req_pool_idx, :60].tolist() \
        == table[c.req_pool_idx, :60].tolist()
    while sched.has_work():
        run_one(sched)
    sched.check_kv_invariant()
    assert all(r.finished for r in (a, b, c, other))
