"""specjet's C++ CPU ops (kernels/cpu_ops.py, csrc/attention.cpp, csrc/layer_ops.cpp).

Exactness is checked on the ops themselves: a row's bits alone == among others, a tree node == the same
token with its keys contiguous, every instruction-set build == the others. Against the torch
implementations (other kernels) only closeness is asserted, at a tolerance a wrong mask, scale or
rotation would fail by orders of magnitude.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specjet.kernels import attention as A
from specjet.kernels import cpu_ops
from specjet.kernels.attention_metadata import build_attention_metadata
from specjet.models.llama import apply_rotary

pytestmark = pytest.mark.skipif(cpu_ops.extension() is None, reason="the C++ CPU ops are not built")

HEADS, KV_HEADS, DIM = 6, 2, 16


def pool(num_slots: int, dtype, seed: int, dim: int = DIM):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_slots, KV_HEADS, dim, generator=gen).to(dtype)
    v = torch.randn(num_slots, KV_HEADS, dim, generator=gen).to(dtype)
    return k, v, gen


def scattered_table(kv_lens: list[int], gen) -> torch.Tensor:
    """Request b's positions in shuffled slots of its own range (slot 0 unused)."""
    table = torch.zeros(len(kv_lens), max(kv_lens), dtype=torch.int64)
    start = 1
    for b, n in enumerate(kv_lens):
        table[b, :n] = torch.randperm(n, generator=gen) + start
        start += n
    return table


def supported_isas(pool_dtype=torch.bfloat16) -> list[str]:
    """The builds this CPU runs that give the lanes' bits for a pool of pool_dtype: every one for a float32 pool; for
    a bf16 pool all but ``amx`` (AMX tiles) and ``bf16dp`` (VDPBF16PS), which score it their own way (their own
    bits: test_builds_of_their_own_bits_*)."""
    return [name for name, code in cpu_ops.ISAS.items() if cpu_ops.extension().isa_supported(code)
            and (name not in cpu_ops.OWN_BITS or pool_dtype == torch.float32)]


def runs(isa: str) -> bool:
    return cpu_ops.extension() is not None and cpu_ops.extension().isa_supported(cpu_ops.ISAS[isa])




def native(q, k, v, meta, isa=None):
    if isa is None:
        return cpu_ops.native_attention(q, k, v, meta, 0.25)
    mask = None if meta.custom_mask is None else meta.custom_mask.contiguous()
    return cpu_ops.extension().paged_attention(q, k, v, meta.kv_indices.contiguous(), meta.kv_lens, meta.q_lens,
                                               meta.q_starts, mask, 0.25, cpu_ops.ISAS[isa])


def tree_mask(batch: int, q_len: int, gen) -> torch.Tensor:
    """Each new token sees itself and a random subset of the earlier ones."""
    mask = torch.rand(batch, q_len, q_len, generator=gen) < 0.5
    return (mask | torch.eye(q_len, dtype=torch.bool)) & torch.tril(torch.ones(q_len, q_len, dtype=torch.bool))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens,tree", [([1, 1, 1, 1], False), ([1, 5, 2, 40], False), ([4, 4, 4, 4], True)],
                         ids=["decode", "extend", "tree"])
def test_each_request_gets_the_bits_it_gets_alone_and_matches_the_torch_path(dtype, q_lens, tree):
    kv_lens = [700, 45, 9, 300]
    kv_lens = [max(n, q) for n, q in zip(kv_lens, q_lens)]
    k, v, gen = pool(sum(kv_lens) + 1, dtype, seed=0)
    table = scattered_table(kv_lens, gen)
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen).to(dtype)
    mask = tree_mask(len(kv_lens), max(q_lens), gen) if tree else None
    meta = build_attention_metadata(table, torch.arange(4), torch.tensor(kv_lens), torch.tensor(q_lens), mask)
    out = native(q, k, v, meta)
    offset = 0
    for b in range(4):
        alone = build_attention_metadata(table, torch.tensor([b]), torch.tensor([kv_lens[b]]),
                                         torch.tensor([q_lens[b]]), None if mask is None else mask[b:b + 1])
        rows = slice(offset, offset + q_lens[b])
        assert torch.equal(out[rows], native(q[rows].contiguous(), k, v, alone)), f"request {b} differs in the batch"
        offset += q_lens[b]
    torch_path = A._attention_float64(q, k, v, meta, 0.25)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), torch_path.float(), rtol=tol, atol=tol)
    reference = A.paged_attention_reference(q.float(), k.float(), v.float(), meta, 0.25)
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


def test_a_request_split_by_query_head_across_threads_keeps_its_bits():
    """With fewer (request, KV head, tile) items than the threads can share evenly, each is split by
    query head (3 KV heads on 2 threads); a row's bits must not change with that split."""
    heads, kv_heads, dim, kv_len = 9, 3, 64, 300
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(2 * kv_len + 1, kv_heads, dim, generator=gen)
    v = torch.randn(2 * kv_len + 1, kv_heads, dim, generator=gen)
    table = scattered_table([kv_len, kv_len], gen)
    q = torch.randn(8, heads, dim, generator=gen)
    ext, threads = cpu_ops.extension(), torch.get_num_threads()

    def run(rows, q_lens):
        b = len(q_lens)
        meta = build_attention_metadata(table[rows], torch.arange(b), torch.full((b,), kv_len), torch.tensor(q_lens))
        return ext.paged_attention(q[:sum(q_lens)].contiguous(), k, v, meta.kv_indices.contiguous(), meta.kv_lens,
                                   meta.q_lens, meta.q_starts, None, 0.125, cpu_ops.isa())
    try:
        torch.set_num_threads(2)
        for q_len in (1, 4):  # 3 items on 2 threads: split; with a second request, 6 items: not split
            alone = run([0], [q_len])
            with_other = run([0, 1], [q_len, 4])
            torch.set_num_threads(1)  # never split
            one_thread = run([0], [q_len])
            torch.set_num_threads(2)
            assert torch.equal(alone, with_other[:q_len]) and torch.equal(alone, one_thread)
    finally:
        torch.set_num_threads(threads)


def test_threads_share_uneven_tiles_by_cost_and_every_row_is_computed_once():
    """A 26-node verify (tiles of 8, 8, 8 and 2 tokens) beside requests of very different context
    lengths: the threads take runs of about equal cost, not equal counts. Every row must come out
    (the output is allocated uninitialised) with the bits of a one-thread run, whatever the thread
    count."""
    heads, kv_heads, dim = 9, 3, 64
    q_lens, kv_lens = [26, 1, 3, 1], [326, 40, 900, 7]
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen)
    v = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen)
    table = scattered_table(kv_lens, gen)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    mask = tree_mask(len(q_lens), max(q_lens), gen)
    meta = build_attention_metadata(table, torch.arange(4), torch.tensor(kv_lens), torch.tensor(q_lens), mask)
    ext, threads = cpu_ops.extension(), torch.get_num_threads()

    def run():
        return ext.paged_attention(q, k, v, meta.kv_indices.contiguous(), meta.kv_lens, meta.q_lens, meta.q_starts,
                                   meta.custom_mask.contiguous(), 0.125, cpu_ops.isa())
    try:
        torch.set_num_threads(1)
        one = run()
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            assert torch.equal(run(), one), f"{n} threads"
    finally:
        torch.set_num_threads(threads)
    reference = A.paged_attention_reference(q, k, v, meta, 0.125)
    torch.testing.assert_close(one, reference, rtol=2e-2, atol=2e-2)


def test_threads_start_their_runs_at_the_boundary_nearest_an_equal_share_of_the_cost():
    """The attention's units go to the threads as runs of consecutive units; each run starts at the unit
    boundary nearest to its equal share of the total cost. A decode step of one request past one key chunk
    (3 KV heads x 2 chunks of 512 and 488 keys) splits 3 + 3 on 2 threads, not 2 + 4; a unit costing
    more than half goes alone."""
    import itertools
    import random

    ext = cpu_ops.extension()
    decode = list(itertools.accumulate([3 * 512.0 + 1] * 3 + [3 * 488.0 + 1] * 3))
    assert ext.cost_share_starts(decode, 2) == [0, 3, 6]
    assert ext.cost_share_starts([10.0, 11.0], 2) == [0, 1, 2]
    assert ext.cost_share_starts([4.0, 8.0, 12.0, 16.0], 4) == [0, 1, 2, 3, 4]
    rng = random.Random(3)
    for _ in range(200):
        n, shares = rng.randint(1, 12), rng.randint(1, 4)
        ends = list(itertools.accumulate(rng.uniform(1.0, 100.0) for _ in range(n)))
        starts = ext.cost_share_starts(ends, shares)
        assert starts[0] == 0 and starts[-1] == n and starts == sorted(starts)
        before = [0.0] + ends  # before[i]: the cost before boundary i
        for s in range(1, shares):
            target = ends[-1] * s / shares
            best = min(abs(b - target) for b in before)
            assert abs(before[starts[s]] - target) <= best + 1e-9, (ends, shares, starts)
    for bad_ends, bad_shares in (([1.0, 2.0], 0), ([2.0, 1.0], 2), ([1.0, float("nan")], 2), ([-1.0], 2)):
        with pytest.raises(ValueError, match="cost_share_starts"):
            ext.cost_share_starts(bad_ends, bad_shares)


@pytest.mark.parametrize("q_len,tree", [(1, False), (9, False), (6, True)], ids=["decode", "extend", "tree"])
def test_a_long_context_in_key_chunks_keeps_its_bits_on_any_threads_and_in_any_batch(q_len, tree):
    """Past 512 keys a row's keys go in fixed chunks, merged in order (attention_body.h kKeyChunk): 1,300 and
    1,025 keys (3 chunks; one key in the last) must give the same bits on 1 to 4 threads, alone or beside a
    short request, close to the float64 path; an extend's causal rows end in different chunks."""
    heads, kv_heads, dim = 9, 3, 64
    kv_lens = [1300, 1025, 40]
    gen = torch.Generator().manual_seed(13)
    k = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen)
    v = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen)
    table = scattered_table(kv_lens, gen)
    q_lens = [q_len, q_len, 1]
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    mask = tree_mask(3, q_len, gen) if tree else None
    ext, threads = cpu_ops.extension(), torch.get_num_threads()

    def run(rows):
        meta = build_attention_metadata(table[rows], torch.arange(len(rows)), torch.tensor(kv_lens)[rows],
                                        torch.tensor(q_lens)[rows], None if mask is None else mask[rows])
        starts = [sum(q_lens[:b]) for b in rows]
        qs = torch.cat([q[s:s + q_lens[b]] for s, b in zip(starts, rows)])
        out = ext.paged_attention(qs, k, v, meta.kv_indices.contiguous(), meta.kv_lens, meta.q_lens, meta.q_starts,
                                  None if mask is None else meta.custom_mask.contiguous(), 0.125, cpu_ops.isa())
        return out, meta, qs
    try:
        torch.set_num_threads(1)
        one, meta, _ = run([0, 1, 2])
        alone = [run([b])[0] for b in range(3)]
        for n in (2, 3, 4):
            torch.set_num_threads(n)
            assert torch.equal(run([0, 1, 2])[0], one), f"{n} threads"
            assert torch.equal(run([1])[0], alone[1]), f"{n} threads, alone"
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone), one)
    torch.testing.assert_close(one, A._attention_float64(q, k, v, meta, 0.125).float(), rtol=1e-5, atol=1e-5)


def test_a_tree_node_gets_the_bits_of_its_path_decoded_contiguously():
    """Node 3 of the tree sees the prefix, nodes 0 and 2 and itself; decoded as a chain of those
    three tokens (keys contiguous, no masked ones between), its last row must have the same bits."""
    prefix, nodes = 50, 5
    k, v, gen = pool(1 + prefix + nodes + 3, torch.bfloat16, seed=1)
    q = torch.randn(nodes, HEADS, DIM, generator=gen).to(torch.bfloat16)
    table = torch.arange(1, 1 + prefix + nodes)[None]
    mask = torch.eye(nodes, dtype=torch.bool)[None].clone()
    mask[0, 3, 0] = mask[0, 3, 2] = True
    mask[0, 2, 0] = True
    tree = native(q, k, v, build_attention_metadata(table, torch.tensor([0]), torch.tensor([prefix + nodes]),
                                                    torch.tensor([nodes]), mask))
    # The chain: copies of node 0, 2 and 3's K/V right after the prefix.
    chain_slots = torch.arange(1 + prefix + nodes, 1 + prefix + nodes + 3)
    for i, node in enumerate((0, 2, 3)):
        k[chain_slots[i]], v[chain_slots[i]] = k[1 + prefix + node], v[1 + prefix + node]
    chain_table = torch.cat([torch.arange(1, 1 + prefix), chain_slots])[None]
    chain = native(q[[0, 2, 3]].contiguous(), k, v, build_attention_metadata(
        chain_table, torch.tensor([0]), torch.tensor([prefix + 3]), torch.tensor([3])))
    assert torch.equal(tree[3], chain[2])
    assert torch.equal(tree[2], chain[1])


@pytest.mark.parametrize("q_dtype,pool_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                (torch.float32, torch.float32)])
def test_a_tree_across_a_key_chunk_boundary_gives_each_node_the_bits_of_its_decode_step(q_dtype, pool_dtype):
    """A row's keys go in chunks of 512 of the keys it sees (attention_body.h kKeyChunk). A tree node's
    non-ancestors lie between its ancestors by position, so where a chunk boundary falls among the tree's nodes
    the node must still be chunked as its decode step is, its ancestors contiguous after the prefix: by rank, not
    by position (by position, nodes past the boundary whose rank was before it took other bits, ~1e-8). Every
    build this CPU runs, its own bits against its own; boundaries 512 and 1,024 inside the tree, at its first
    node and just past it."""
    nodes, dim = 12, 64
    gen = torch.Generator().manual_seed(29)
    builds = [name for name, code in cpu_ops.ISAS.items() if cpu_ops.extension().isa_supported(code)]
    for prefix in (500, 505, 509, 510, 511, 512, 1015, 1020):
        n = prefix + nodes
        k = torch.randn(n + 1, KV_HEADS, dim, generator=gen).to(pool_dtype)
        v = torch.randn(n + 1, KV_HEADS, dim, generator=gen).to(pool_dtype)
        q = torch.randn(nodes, HEADS, dim, generator=gen).to(q_dtype)
        mask = tree_mask(1, nodes, gen)
        table = scattered_table([n], gen)
        tree_meta = build_attention_metadata(table, torch.tensor([0]), torch.tensor([n]), torch.tensor([nodes]), mask)
        for isa in builds:
            tree = native(q, k, v, tree_meta, isa)
            for i in range(nodes):
                seen = table[0, :prefix].tolist() + [table[0, prefix + j].item() for j in range(nodes) if mask[0, i, j]]
                alone = native(q[i:i + 1].contiguous(), k, v, build_attention_metadata(
                    torch.tensor([seen]), torch.tensor([0]), torch.tensor([len(seen)]), torch.tensor([1])), isa)
                assert torch.equal(alone[0], tree[i]), (isa, prefix, i)


# Head dims: one lane group; several, with a tail past the value sums' register block (64); key counts
# that are not whole blocks of the wider builds' scoring (16 and 8 keys at a time). A bf16 pool beside
# float32 rows (the default beside quantized weights): its values widened in registers, or once for a
# tile's chunk where the build's value blocks hold fewer rows than the tile (a different split per build).
@pytest.mark.parametrize("dtype,pool_dtype,dim", [(torch.float32, torch.float32, DIM), (torch.float32, torch.float32, 72),
                                                  (torch.bfloat16, torch.bfloat16, 64),
                                                  (torch.float32, torch.bfloat16, 64),
                                                  (torch.float32, torch.bfloat16, 80)])
def test_every_instruction_set_build_gives_the_same_bits(dtype, pool_dtype, dim):
    isas = supported_isas(pool_dtype)
    assert "base" in isas
    kv_lens, q_lens = [130, 33], [1, 20]
    k, v, gen = pool(sum(kv_lens) + 1, pool_dtype, seed=2, dim=dim)
    table = scattered_table(kv_lens, gen)
    q = torch.randn(sum(q_lens), HEADS, dim, generator=gen).to(dtype)
    meta = build_attention_metadata(table, torch.arange(2), torch.tensor(kv_lens), torch.tensor(q_lens))
    outs = [native(q, k, v, meta, isa) for isa in isas]
    for isa, out in zip(isas[1:], outs[1:]):
        assert torch.equal(outs[0], out), f"{isa} differs from {isas[0]}"


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dim", [64, 80])
def test_tiles_scored_from_transposed_keys_give_every_build_the_same_bits(tree, dim):
    """Tiles of 8 rows or more score blocks of keys from a transposed copy in the AVX-512 build, 4 rows
    at a time and two blocks of keys at a time: tiles of 9, 15 and 21 rows (3, 5 and 7 tokens of a 3-head
    group) leave 1 and 3 rows over, the contexts end inside a block of keys after an even or an odd number
    of whole blocks (2, 6 and 3: the last of an odd number is scored alone), and a tree mask hides some new
    tokens; every build gives the bits of the base one, which scores key by key. One thread: with more, a
    few units are split by query head and the tiles would be too small for the transposed path."""
    isas = supported_isas()
    kv_lens, q_lens = [40, 100, 57], [3, 5, 7]
    k, v, gen = pool(sum(kv_lens) + 1, torch.bfloat16, seed=11, dim=dim)
    q = torch.randn(sum(q_lens), HEADS, dim, generator=gen)
    mask = None
    if tree:
        mask = torch.zeros(len(q_lens), max(q_lens), max(q_lens), dtype=torch.bool)
        for b, n in enumerate(q_lens):  # node j under node j - 2 (nodes 0 and 1 under the root, node 0)
            for j in range(n):
                mask[b, j, list(range(j, -1, -2))] = True
                mask[b, j, 0] = True
    meta = build_attention_metadata(scattered_table(kv_lens, gen), torch.arange(3), torch.tensor(kv_lens),
                                    torch.tensor(q_lens), mask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outs = {isa: native(q, k, v, meta, isa) for isa in isas}
    finally:
        torch.set_num_threads(threads)
    for isa in isas:
        assert torch.equal(outs["base"], outs[isa]), isa


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("dim", [64, 80])
def test_tiles_that_share_a_kv_heads_keys_give_every_build_and_thread_count_the_same_bits(tree, dim):
    """A thread's next tile of the same KV head and key chunk takes the keys and values the previous one widened
    (or transposed) instead of reading them again: 5 new tokens of a 3-head group split by query head on 2
    threads (5 rows scored key-block by key-block, then 10 from transposed blocks), 9 and 17 tokens in tiles of
    8 (24 transposed rows, then 3 rows key-block by key-block; causal tiles see more keys than the one before),
    80 dims (keys padded to 96). Every build and thread count gives the base build's bits on one thread (the amx and
    bf16dp builds their own bits on one thread), and the torch path's values."""
    isas = supported_isas(torch.float32)
    heads, kv_heads = 9, 3
    kv_lens, q_lens = [61, 140, 300], [5, 9, 17]
    gen = torch.Generator().manual_seed(dim + tree)
    k = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    table = scattered_table(kv_lens, gen)
    threads = torch.get_num_threads()
    try:
        for b in range(len(kv_lens)):  # one request a call: few tiles, so the split by query head happens
            q = torch.randn(q_lens[b], heads, dim, generator=gen)
            mask = tree_mask(1, q_lens[b], gen) if tree else None
            meta = build_attention_metadata(table[b:b + 1, :kv_lens[b]], torch.arange(1), torch.tensor(kv_lens[b:b + 1]),
                                            torch.tensor(q_lens[b:b + 1]), mask)
            outs = {}
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                for isa in isas:
                    outs[isa, n] = native(q, k, v, meta, isa)
            first = outs["base", 1]
            for key, out in outs.items():
                assert torch.equal(out, outs[key[0], 1] if key[0] in cpu_ops.OWN_BITS else first), (b, key)
            torch.set_num_threads(threads)
            # amx: q to ~16 bits, the tiles' own sums; bf16dp: q to bf16
            for isa, tol in {"base": 1e-5, "amx": 3e-5, "bf16dp": 1e-2}.items():
                if isa in isas:
                    torch.testing.assert_close(outs[isa, 1], A._attention_float64(q, k, v, meta, 0.25).float(),
                                               rtol=tol, atol=tol)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dim", [64, 128])
def test_a_verify_tiles_value_sums_in_key_chunks_give_each_token_its_decode_bits(dim):
    """A tile of more rows than one register block of the weights x V sums takes the keys 64 at a time, every block
    of rows through a chunk before the next, the sums parked in memory between chunks (attention_body.h
    kPvKeyChunk); a lone decode step's 3 rows take the whole range in one pass. 16 causal tokens after 203 cached
    ones (chunk boundaries inside the cached keys and inside the new ones; 128 dims: a second block of dims, which
    makes no denominators) must give each token's row the bits of that token decoded alone, on every build."""
    heads, kv_heads, prefix, n = 9, 3, 203, 16
    gen = torch.Generator().manual_seed(dim)
    k = torch.randn(prefix + n + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(prefix + n + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    table = scattered_table([prefix + n], gen)
    q = torch.randn(n, heads, dim, generator=gen)
    extend = build_attention_metadata(table, torch.arange(1), torch.tensor([prefix + n]), torch.tensor([n]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # whole tiles of 8 tokens (24 rows), not split by query head
        for isa in supported_isas():
            out = native(q, k, v, extend, isa)
            for j in range(n):
                alone = build_attention_metadata(table[:, :prefix + j + 1], torch.arange(1), torch.tensor([prefix + j + 1]),
                                                 torch.tensor([1]))
                assert torch.equal(out[j:j + 1], native(q[j:j + 1].contiguous(), k, v, alone, isa)), (isa, j)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, A._attention_float64(q, k, v, extend, 0.25).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_len", [1, 16])
def test_nothing_is_kept_from_one_call_to_the_next(q_len):
    """The keys a thread keeps between tiles live for one call: a layer stack passes the same slot table to every
    layer's pool. Two pools read through the same table one after the other (one KV head, so a thread's first tile
    of the second call has the tag of its last of the first) give each its own result, on every build and 1-2
    threads."""
    isas = supported_isas(torch.float32)
    ext = cpu_ops.extension()
    kv_len, dim = 90, 64
    gen = torch.Generator().manual_seed(q_len)
    pools = [(torch.randn(kv_len + 1, 1, dim, generator=gen).to(torch.bfloat16),
              torch.randn(kv_len + 1, 1, dim, generator=gen).to(torch.bfloat16)) for _ in range(2)]
    q = torch.randn(q_len, 3, dim, generator=gen)
    mask = tree_mask(1, q_len, gen) if q_len > 1 else None
    meta = build_attention_metadata(scattered_table([kv_len], gen), torch.arange(1), torch.tensor([kv_len]),
                                    torch.tensor([q_len]), mask)
    table = meta.kv_indices.contiguous()
    cm = None if meta.custom_mask is None else meta.custom_mask.contiguous()

    def attend(k, v, isa, slots):
        return ext.paged_attention(q, k, v, slots, meta.kv_lens, meta.q_lens, meta.q_starts, cm, 0.25, cpu_ops.ISAS[isa])

    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for isa in isas:
                expected = [attend(k, v, isa, table.clone()) for k, v in pools]  # a table of its own each
                got = [attend(k, v, isa, table) for k, v in pools]  # one table for both, as a stack's layers
                assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (n, isa)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("group", [1, 2])
def test_a_bf16_pool_read_by_few_rows_gives_every_build_the_float_pools_bits(group):
    """Tiles of as few rows as a build's value blocks hold (decode rows of a small GQA group: 1 in the base
    build, 2 in the AVX2 one, up to 4 in the AVX-512 one) widen a bf16 pool's values in registers: the
    bits of a float32 pool holding the same values, in every build (but amx, whose bf16 pools are scored on tiles)."""
    isas = supported_isas()
    kv_heads, dim, kv_lens, q_lens = 2, 64, [90, 37], [1, 1]
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(sum(q_lens), group * kv_heads, dim, generator=gen)
    meta = build_attention_metadata(scattered_table(kv_lens, gen), torch.arange(2), torch.tensor(kv_lens),
                                    torch.tensor(q_lens))
    for isa in isas:
        assert torch.equal(native(q, k, v, meta, isa), native(q, k.float(), v.float(), meta, isa)), isa


@pytest.mark.parametrize("build,dim", [("amx", 64), ("amx", 80), ("bf16dp", 64), ("bf16dp", 128)])
def test_builds_of_their_own_bits_keep_every_invariance_and_the_lanes_values(build, dim):
    """The amx build scores a bf16 pool's keys on tiles, 16 keys a tile (read in place where their slots follow each
    other, else gathered; 80 dims padded to 96), q split into bf16 hi + lo; the bf16dp build by VDPBF16PS on q rounded
    to bf16 (a tile of 8+ rows from blocks of keys transposed as pairs of dimensions, a decode step's rows and the
    keys past the last whole block from the keys in place; a head_dim not a multiple of 32 takes the avx512 lanes),
    and its weights x V on the weights rounded to bf16, two keys a step (a tile's values interleaved in scratch, a
    decode step's from the pool; the denominators 16 rows a vector, or beside a decode step's products).
    Each score is one key's and one row's sum, so: a 16-node
    tree's rows (two tiles of 8 tokens x 3 heads, a context of 300 and one past a key chunk) give the bits of each
    token alone with its keys contiguous; the same keys in scattered slots give the same bits; requests batched give
    their bits alone, on 1-3 threads; the values stay close to the lanes' build and the torch path (amx 2e-5; bf16dp
    1e-2: q to bf16's 8 bits); and a float32 pool takes the avx512 build's lanes, bit for bit."""
    if not runs(build):
        pytest.skip(f"this CPU does not run the {build} build (AMX-BF16 tiles, or AVX-512 BF16)")
    heads, kv_heads, nodes = 9, 3, 16
    tol = 2e-5 if build == "amx" else 1e-2
    gen = torch.Generator().manual_seed(dim)
    amx = cpu_ops.ISAS[build]
    ext = cpu_ops.extension()

    def attend(q, k, v, table, kv_lens, q_lens, mask=None, isa=amx):
        meta = build_attention_metadata(table, torch.arange(len(kv_lens)), torch.tensor(kv_lens), torch.tensor(q_lens),
                                        mask)
        cm = None if meta.custom_mask is None else meta.custom_mask.contiguous()
        out = ext.paged_attention(q, k, v, meta.kv_indices.contiguous(), meta.kv_lens, meta.q_lens, meta.q_starts, cm,
                                  0.125, isa)
        return out, meta

    threads = torch.get_num_threads()
    try:
        for prefix in (300, 600):
            n = prefix + nodes
            k = torch.randn(2 * n + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
            v = torch.randn(2 * n + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
            q = torch.randn(nodes, heads, dim, generator=gen)
            mask = tree_mask(1, nodes, gen)
            table = torch.arange(1, n + 1).view(1, n)  # contiguous: whole blocks read in place
            out, meta = attend(q, k, v, table, [n], [nodes], mask)
            # the same keys and values in shuffled slots of the pool's second half: every block gathered
            shuffled = torch.randperm(n, generator=gen) + n + 1
            k[shuffled], v[shuffled] = k[1:n + 1].clone(), v[1:n + 1].clone()
            assert torch.equal(attend(q, k, v, shuffled.view(1, n), [n], [nodes], mask)[0], out)
            for i in range(nodes):
                seen = list(range(1, prefix + 1)) + [prefix + 1 + j for j in range(nodes) if mask[0, i, j]]
                alone, _ = attend(q[i:i + 1].contiguous(), k, v, torch.tensor([seen]), [len(seen)], [1])
                assert torch.equal(alone[0], out[i]), (prefix, i)
            for t in (1, 3):
                torch.set_num_threads(t)
                assert torch.equal(attend(q, k, v, table, [n], [nodes], mask)[0], out), (prefix, t)
            torch.set_num_threads(threads)
            lanes, _ = attend(q, k, v, table, [n], [nodes], mask, isa=cpu_ops.ISAS["avx512"])
            torch.testing.assert_close(out, lanes, rtol=tol, atol=tol)
            torch.testing.assert_close(out, A._attention_float64(q, k, v, meta, 0.125).float(), rtol=tol, atol=tol)
            if build == "bf16dp":  # not the lanes' bits: the products are bf16's
                assert not torch.equal(out, lanes)
            floats = attend(q, k.float(), v.float(), table, [n], [nodes], mask)[0]
            assert torch.equal(floats, attend(q, k.float(), v.float(), table, [n], [nodes], mask,
                                              isa=cpu_ops.ISAS["avx512"])[0])
        # decode rows of two requests (3 rows a KV head, or 1-2 when split by query head) batched and alone
        kv_lens = [37, 300]
        k = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
        v = torch.randn(sum(kv_lens) + 1, kv_heads, dim, generator=gen).to(torch.bfloat16)
        table = scattered_table(kv_lens, gen)
        q = torch.randn(2, heads, dim, generator=gen)
        both, _ = attend(q, k, v, table, kv_lens, [1, 1])
        for b in range(2):
            alone, _ = attend(q[b:b + 1].contiguous(), k, v, table[b:b + 1, :kv_lens[b]], kv_lens[b:b + 1], [1])
            assert torch.equal(alone[0], both[b]), b
        if build == "bf16dp":  # pairs of dimensions 16 words a step: another head_dim takes the avx512 lanes
            k80 = torch.randn(301, kv_heads, 80, generator=gen).to(torch.bfloat16)
            q80 = torch.randn(nodes, heads, 80, generator=gen)
            table80, mask80 = torch.arange(1, 301).view(1, 300), tree_mask(1, nodes, gen)
            assert torch.equal(attend(q80, k80, k80, table80, [300], [nodes], mask80)[0],
                               attend(q80, k80, k80, table80, [300], [nodes], mask80, isa=cpu_ops.ISAS["avx512"])[0])
    finally:
        torch.set_num_threads(threads)


def head_major(t: torch.Tensor) -> torch.Tensor:
    """The same [slots, H_kv, D] values in head-major memory (models/kv_cache.py's CPU layout)."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_major_pool_gives_the_bits_of_a_slot_major_one(dtype):
    """The pool's layout is memory addresses only: attention over the same keys and values (decode,
    extend and tree rows, a context past one key chunk) and the RoPE + K/V write give the same bits."""
    kv_lens, q_lens = [700, 45, 9], [1, 6, 4]
    k, v, gen = pool(sum(kv_lens) + 1, dtype, seed=7)
    table = scattered_table(kv_lens, gen)
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen).to(dtype)
    for mask in (None, tree_mask(3, max(q_lens), gen)):
        meta = build_attention_metadata(table, torch.arange(3), torch.tensor(kv_lens), torch.tensor(q_lens),
                                        custom_mask=mask)
        hk, hv = head_major(k), head_major(v)
        assert hk.stride(0) == DIM and torch.equal(hk, k)
        assert torch.equal(native(q, hk, hv, meta), native(q, k, v, meta))

    rows = 5
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(dtype)
    angles = torch.rand(rows, DIM // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(rows, generator=gen) + 1
    caches = {}
    for name, make in (("slot", lambda t: t.clone()), ("head", head_major)):
        kc, vc = make(torch.zeros(rows + 2, KV_HEADS, DIM, dtype=dtype)), make(torch.zeros(rows + 2, KV_HEADS, DIM, dtype=dtype))
        caches[name] = (cpu_ops.rope_store(qkv, cos, sin, kc, vc, slots, HEADS), kc, vc)
    for a, b in zip(caches["slot"], caches["head"]):
        assert torch.equal(a, b)
    assert caches["head"][1].stride(0) == DIM, "the write kept the head-major layout"


def test_a_pool_of_another_layout_is_refused():
    """Rows of D must be contiguous and K, V strided alike: anything else would be read at wrong addresses."""
    k, v, gen = pool(20, torch.float32, seed=8)
    q = torch.randn(1, HEADS, DIM)
    meta = build_attention_metadata(torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([3]), torch.tensor([1]))
    strided = torch.randn(20, KV_HEADS, 2 * DIM)[:, :, ::2]
    for bad_k, bad_v in ((strided, strided.clone()), (head_major(k), v)):
        with pytest.raises(RuntimeError, match="strided alike|rows of D contiguous"):
            native(q, bad_k, bad_v, meta)
        qkv, cs = torch.randn(1, (HEADS + 2 * KV_HEADS) * DIM), torch.ones(1, DIM // 2)
        with pytest.raises(RuntimeError, match="strided alike|rows of D contiguous"):
            cpu_ops.rope_store(qkv, cs, cs, bad_k, bad_v, torch.tensor([1]), HEADS)


def test_bad_metadata_is_refused_not_read_out_of_bounds():
    k, v, gen = pool(20, torch.float32, seed=3)
    q = torch.randn(1, HEADS, DIM)
    meta = build_attention_metadata(torch.tensor([[1, 2, 99]]), torch.tensor([0]), torch.tensor([3]), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="outside the cache"):
        native(q, k, v, meta)
    meta = build_attention_metadata(torch.tensor([[1, 2, 3]]), torch.tensor([0]), torch.tensor([3]), torch.tensor([1]))
    for start in (1, 2 ** 63 - 1):  # past q's rows; and a start whose sum with q_len wraps around
        with pytest.raises(RuntimeError, match="outside its tensors"):
            cpu_ops.extension().paged_attention(q, k, v, meta.kv_indices, meta.kv_lens, meta.q_lens,
                                                torch.tensor([start]), None, 0.25, cpu_ops.isa())
    with pytest.raises(RuntimeError, match="dtype"):  # a float32 pool beside bf16 queries (only the reverse is taken)
        native(q.bfloat16(), k, v, meta)
    with pytest.raises(RuntimeError, match="dtype"):  # keys and values of different dtypes
        native(q, k.bfloat16(), v, meta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_torch_and_keep_a_rows_bits_in_any_batch(dtype):
    gen = torch.Generator().manual_seed(4)
    rows, hidden, eps = 7, 96, 1e-5
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    delta = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]

    def torch_norm(t):
        tf = t.float()
        return w.float() * tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)

    normed = cpu_ops.rms_norm(x, w, eps)
    torch.testing.assert_close(normed.float(), torch_norm(x), rtol=tol, atol=tol)
    summed, normed_sum = cpu_ops.rms_norm(x, w, eps, residual=delta)
    torch.testing.assert_close(summed.float(), (x.float() + delta.float()), rtol=tol, atol=tol)
    torch.testing.assert_close(normed_sum.float(), torch_norm(summed), rtol=tol, atol=tol)

    gate_up = torch.randn(rows, 2 * hidden, generator=gen).to(dtype) * 4
    act = cpu_ops.silu_mul(gate_up)
    g, u = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(act.float(), F.silu(g) * u, rtol=tol, atol=tol)

    heads, kv_heads, dim = 3, 1, 32
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    angles = torch.rand(rows, dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    k_cache = torch.zeros(rows + 3, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(rows, generator=gen) + 2
    q = cpu_ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, heads)
    qf, kf, vf = qkv.float().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    torch.testing.assert_close(q.float(), apply_rotary(qf.view(rows, heads, dim), cos.float(), sin.float()),
                               rtol=tol, atol=tol)
    torch.testing.assert_close(k_cache[slots].float(), apply_rotary(kf.view(rows, kv_heads, dim), cos.float(),
                                                                    sin.float()), rtol=tol, atol=tol)
    assert torch.equal(v_cache[slots], qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim))
    assert not k_cache[:2].any() and not k_cache[rows + 2:].any(), "a slot nobody named was written"

    # Batch invariance: each row alone gives the bits it gets among the others.
    for r in range(rows):
        one = slice(r, r + 1)
        assert torch.equal(cpu_ops.rms_norm(x[one], w, eps), normed[one])
        assert torch.equal(cpu_ops.rms_norm(x[one], w, eps, residual=delta[one])[1], normed_sum[one])
        assert torch.equal(cpu_ops.silu_mul(gate_up[one]), act[one])
        assert torch.equal(cpu_ops.rope_store(qkv[one], cos[one], sin[one], k_cache, v_cache, slots[one], heads), q[one])


def test_bf16_rows_round_where_torch_rounds_ties_and_specials_included():
    """The bf16 layer ops run on float lanes and round by bit operations of their own: each bf16 result
    must be the float result rounded as torch rounds it (nearest even, NaN stays NaN, infinities
    kept), including sums that fall exactly between two bf16 values."""
    gen = torch.Generator().manual_seed(5)
    rows, hidden = 5, 80
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e38, -3e38, 1e-39, 90.0, -90.0])
    x = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    x.view(-1)[:specials.numel()] = specials.to(torch.bfloat16)
    # x + delta lands on a tie for every element of the second row: delta is half x's last bit.
    delta = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16)
    _, exponent = torch.frexp(x[1].float())  # |x| in [2^(e-1), 2^e): its bf16 ulp is 2^(e-8)
    delta[1] = torch.ldexp(torch.ones(hidden), exponent - 9).to(torch.bfloat16)
    ties = (x[1].float() + delta[1].float()).view(torch.int32) & 0xFFFF
    assert int((ties == 0x8000).sum()) == hidden
    w = torch.ones(hidden, dtype=torch.bfloat16)

    def same(a, b):  # bit equality, every NaN alike
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.float().nan_to_num(0.5), b.float().nan_to_num(0.5))

    summed, _ = cpu_ops.rms_norm(x, w, 1e-5, residual=delta)
    assert same(summed, (x.float() + delta.float()).to(torch.bfloat16))

    # silu(g) * u: silu rounded to bf16, then the product rounded (torch's bf16 silu(g) * u); the
    # float op gives the same exp, so the float path rounded by torch is the reference.
    gate_up = torch.randn(rows, 2 * hidden, generator=gen).mul(6).to(torch.bfloat16)
    gate_up.view(-1)[:specials.numel()] = specials.to(torch.bfloat16)
    g, u = gate_up.float().chunk(2, dim=-1)
    silu = cpu_ops.silu_mul(torch.cat([g, torch.ones_like(u)], dim=-1)).to(torch.bfloat16)
    assert same(cpu_ops.silu_mul(gate_up), (silu.float() * u).to(torch.bfloat16))

    # RoPE: x1 c - x2 s and x2 c + x1 s in float (separate products and sums), rounded once.
    heads, kv_heads, dim = 2, 1, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(torch.bfloat16)
    qkv.view(-1)[:specials.numel()] = specials.to(torch.bfloat16)
    angles = torch.rand(rows, dim // 2, generator=gen) * 6
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    k_cache = torch.zeros(rows, kv_heads, dim, dtype=torch.bfloat16)
    q = cpu_ops.rope_store(qkv, cos, sin, k_cache, torch.zeros_like(k_cache), torch.arange(rows), heads)
    qf = qkv.float()[:, :heads * dim].view(rows, heads, dim)
    x1, x2 = qf.chunk(2, dim=-1)
    c, s_ = cos.float()[:, None, :], sin.float()[:, None, :]
    expected = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1).to(torch.bfloat16)
    assert same(q, expected)


def test_layer_ops_refuse_bad_inputs_with_a_clear_error():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="residual must match"):
        cpu_ops.rms_norm(x, torch.ones(8), 1e-5, residual=torch.randn(3, 8))
    cache = torch.zeros(4, 1, 4)
    qkv, cs = torch.randn(2, 12), torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_ops.rope_store(qkv, cs, cs, cache, cache.clone(), torch.tensor([1, 4]), 1)
    with pytest.raises(RuntimeError, match="qkv width"):
        cpu_ops.rope_store(torch.randn(2, 16), cs, cs, cache, cache.clone(), torch.tensor([1, 2]), 1)
    with pytest.raises(RuntimeError, match="odd width"):
        cpu_ops.silu_mul(torch.randn(2, 5))


def test_the_models_native_path_matches_its_torch_path(tiny_model_dir):
    """The tiny model through the C++ ops and through torch ops (same weights), fed the same tokens: a
    prefill and a few decode steps give close logits (other kernels: closeness, not bits)."""
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.forward_batch import ForwardBatch, ForwardMode
    from specjet.models.runner import ModelRunner
    from specjet.models.weights import load_state_dict

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_model_dir))
    runners = [ModelRunner(config, load_state_dict(tiny_model_dir), "float32", "cpu", 64, 0.0, 1) for _ in range(2)]
    assert runners[1].model.use_native_ops(False) is False
    assert runners[0].model.layers[0].native_ops, "the runner turns the C++ ops on"
    table = torch.arange(1, 41)[None]
    ids = torch.randint(0, config.vocab_size, (16,), generator=torch.Generator().manual_seed(5))
    logits = []
    for runner in runners:
        seen = []
        for step in range(5):  # the first 12 tokens as a prefill, then one token per decode step
            start = 0 if step == 0 else 11 + step
            positions = torch.arange(start, 12 + step)
            batch = ForwardBatch.build(
                ForwardMode.EXTEND if step == 0 else ForwardMode.DECODE, input_ids=ids[positions], positions=positions,
                out_cache_loc=table[0, positions], req_to_token=table, req_pool_indices=torch.tensor([0]),
                kv_lens=torch.tensor([12 + step]), q_lens=torch.tensor([len(positions)]), logits="last")
            seen.append(runner.forward(batch).logits[-1])
        logits.append(torch.stack(seen))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_the_start_up_log_names_the_attention_build_and_its_products(monkeypatch):
    """describe_attention (the runner logs it): the default build, and whether a pool gets bf16 products (bf16dp on a
    bf16 pool whose head_dim is a multiple of 32) or the float32 lanes; a forced build is named as forced."""
    monkeypatch.delenv(cpu_ops.ISA_ENV, raising=False)  # the default build, even where the environment forces one
    try:
        cpu_ops.isa.cache_clear()
        default = cpu_ops.describe_attention(torch.bfloat16, 64)
        if runs("bf16dp"):
            assert default.startswith("attention: bf16dp build (auto)") and "bf16 products" in default
            assert "float32 lanes" in cpu_ops.describe_attention(torch.bfloat16, 80)
        else:
            assert "float32 lanes" in default and "bf16dp" not in default
        assert "float32 lanes" in cpu_ops.describe_attention(torch.float32, 64)
        monkeypatch.setenv(cpu_ops.ISA_ENV, "avx2" if runs("avx2") else "base")
        cpu_ops.isa.cache_clear()
        forced = cpu_ops.describe_attention(torch.bfloat16, 64)
        assert f"({cpu_ops.ISA_ENV})" in forced and "float32 lanes" in forced
    finally:
        monkeypatch.delenv(cpu_ops.ISA_ENV, raising=False)
        cpu_ops.isa.cache_clear()


def test_a_forced_attention_instruction_set_is_checked(monkeypatch):
    """SPECJET_ATTENTION_ISA names a build: an unknown name, or one this CPU cannot run (amx without AMX-BF16, bf16dp
    without AVX-512 BF16), is a clear error; amx runs only when asked for, never as the default; the default is
    bf16dp on a CPU that runs it (VDPBF16PS products), else the widest lanes build."""
    try:
        monkeypatch.setenv(cpu_ops.ISA_ENV, "avx1024")
        cpu_ops.isa.cache_clear()
        with pytest.raises(ValueError, match="SPECJET_ATTENTION_ISA='avx1024'"):
            cpu_ops.isa()
        for own in cpu_ops.OWN_BITS:
            monkeypatch.setenv(cpu_ops.ISA_ENV, own)
            cpu_ops.isa.cache_clear()
            if runs(own):
                assert cpu_ops.isa() == cpu_ops.ISAS[own]
            else:
                with pytest.raises(ValueError, match=f"SPECJET_ATTENTION_ISA='{own}'"):
                    cpu_ops.isa()
        monkeypatch.delenv(cpu_ops.ISA_ENV)
        cpu_ops.isa.cache_clear()
        lanes = max(cpu_ops.ISAS[name] for name in supported_isas())
        assert cpu_ops.isa() == (cpu_ops.ISAS["bf16dp"] if runs("bf16dp") else lanes)
        assert cpu_ops.isa() != cpu_ops.ISAS["amx"]
    finally:
        monkeypatch.delenv(cpu_ops.ISA_ENV, raising=False)
        cpu_ops.isa.cache_clear()
