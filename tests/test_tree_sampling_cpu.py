"""The C++ sampled tree walk (csrc/sampling.cpp ``verify_tree_sample``, kernels/tree_verify.py
``verify_trees_sampling_cpu``): a node's token drawn only when the path reaches it, bit for bit as plain decoding's
CPU draw (``sample_lists``) draws it with the coin of its depth, grammar masks included; against the torch
reference (``verify_tree_sampling_reference`` over ``filtered_probs`` of every node) on the same coins, and against
the target distribution itself."""
from __future__ import annotations

import math

import pytest
import torch

from specjet.grammar import apply_token_bitmask_
from specjet.kernels import cpu_ops
from specjet.kernels.sampling import SamplingTensors, filtered_probs, sample_lists
from specjet.kernels.tree import build_tree
from specjet.kernels.tree_verify import verify_tree_sampling_reference, verify_trees_sampling_cpu
from test_tree_kernels import (DIST_PARENTS, DIST_PROBS, DIST_TOKENS, TV_BOUND, committed_tokens,
                               distribution_coins, random_parents, tv_distance_report)

pytestmark = pytest.mark.skipif(cpu_ops.extension() is None, reason="specjet's C++ CPU ops are not built")


def _params(rows: list[tuple[float, int, float, float]]) -> SamplingTensors:
    return SamplingTensors.from_lists(*(list(column) for column in zip(*rows)))


def _walk(logits, tokens, parents, coins, rows, grammar=None):
    """The C++ walk of B trees of N nodes each: logits [B * N, V], tokens / parents / coins [B, N]."""
    batch, nodes = tokens.shape
    return verify_trees_sampling_cpu(logits, [b * nodes for b in range(batch)], tokens.tolist(), parents.tolist(),
                                     list(coins), _params(rows), grammar)


def _reference(logits, tokens, parents, coins, rows):
    batch, nodes = tokens.shape
    per_node = _params([row for row in rows for _ in range(nodes)])
    probs = filtered_probs(logits, per_node).view(batch, nodes, -1)
    path, lens, bonus = verify_tree_sampling_reference(tokens, build_tree(parents, torch.zeros(batch, dtype=torch.int64)),
                                                       probs, coins)
    return [(p[:n], b) for p, n, b in zip(path.tolist(), lens.tolist(), bonus.tolist())]


def test_the_walk_follows_the_target_distribution():
    """The hand-made two-level tree of test_tree_kernels: the committed tokens' distribution (first token, second
    after each child) within the TV bound that a biased verifier fails; the same outcome as the reference's on
    nearly every coin."""
    coins = distribution_coins(0)
    draws = coins.shape[0]
    logits = torch.tensor(DIST_PROBS).log().repeat(draws, 1)
    tokens = torch.tensor([DIST_TOKENS]).expand(draws, -1)
    parents = torch.tensor([DIST_PARENTS]).expand(draws, -1)
    rows = [(1.0, -1, 1.0, 0.0)] * draws
    walked = _walk(logits, tokens, parents, coins, rows)
    report = tv_distance_report([committed_tokens(path, bonus) for path, bonus in walked])
    assert all(v < TV_BOUND for v in report.values()), report
    reference = _reference(logits, tokens, parents, coins, rows)
    assert sum(a == b for a, b in zip(walked, reference)) >= 0.999 * draws
    assert 0.3 < sum(len(path) >= 2 for path, _ in walked) / draws < 0.9


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, -1, 1.0, 0.0), (0.7, -1, 0.9, 0.0), (1.3, 20, 1.0, 0.0), (0.8, -1, 1.0, 0.1), (1.0, 5, 0.8, 0.05),
    (0.6, 300, 0.99, 0.0),
])
def test_the_walk_makes_the_references_decisions(temperature, top_k, top_p, min_p):
    """Random trees (some deep, siblings sharing tokens) over a real-sized vocabulary, children's tokens made
    likely so paths run deep: the same path and bonus as the torch reference on the same coins for >= 99% of the
    trees (the two compute a node's weights with different exps, so a coin at the edge of two outcomes may fall
    either way), with every filter exercised."""
    gen = torch.Generator().manual_seed(int(temperature * 10) + top_k)
    batch, nodes, vocab = 160, 10, 10_000
    parents = random_parents(batch, nodes, gen)
    tokens = torch.randint(0, 40, (batch, nodes), generator=gen)  # few distinct tokens: repeats among siblings
    logits = torch.randn(batch, nodes, vocab, generator=gen) * 2.5
    for b in range(batch):
        for child in range(1, nodes):
            logits[b, parents[b, child], tokens[b, child]] += 7.0 + 5.0 * float(torch.rand((), generator=gen))
    logits = logits.view(batch * nodes, vocab)
    coins = torch.rand(batch, nodes, generator=gen)
    rows = [(temperature, top_k, top_p, min_p)] * batch
    walked = _walk(logits, tokens, parents, coins, rows)
    reference = _reference(logits, tokens, parents, coins, rows)
    assert sum(a == b for a, b in zip(walked, reference)) >= 0.99 * batch
    assert max(len(path) for path, _ in walked) >= 4
    # A request's outcome does not depend on the others in the call.
    for b in (0, 57, 159):
        alone = verify_trees_sampling_cpu(logits[b * nodes:(b + 1) * nodes], [0], [tokens[b].tolist()],
                                          [parents[b].tolist()], [coins[b]], _params(rows[:1]))
        assert alone[0] == walked[b]


@pytest.mark.parametrize("constrained", [False, True])
def test_every_committed_token_is_plain_decodings_draw_with_its_depths_coin(constrained):
    """The property sampled speculation rests on (kernels/coins.py): along each walked path, the token after the
    node of depth d is exactly what ``sample_lists`` (plain decoding's draw) gives for that node's row with coin
    d, under a grammar's bitmask too (rows allowing few tokens take the sparse path, others the masked copy), and
    the walk stops exactly where no child holds that draw. The walk reads the logits as the verifier leaves them
    (masked in place), plain decoding's draw the unmasked row through the mask."""
    gen = torch.Generator().manual_seed(21 + constrained)
    batch, nodes, vocab = 120, 9, 6_000
    parents = random_parents(batch, nodes, gen)
    tokens = torch.randint(0, 30, (batch, nodes), generator=gen)
    logits = torch.randn(batch, nodes, vocab, generator=gen) * 2.0
    for b in range(batch):
        for child in range(1, nodes):
            logits[b, parents[b, child], tokens[b, child]] += 6.0 + 4.0 * float(torch.rand((), generator=gen))
    logits = logits.view(batch * nodes, vocab)
    grammar = None
    if constrained:  # half the rows allow 40 tokens (the children's among them), the others all but 200
        words = (vocab + 31) // 32
        bits = torch.zeros(batch * nodes, vocab, dtype=torch.bool)
        for r in range(batch * nodes):
            if r % 2:
                bits[r, torch.randperm(vocab, generator=gen)[:40]] = True
                bits[r, :30] = True
            else:
                bits[r] = True
                bits[r, torch.randperm(vocab, generator=gen)[:200]] = False
        padded = torch.zeros(batch * nodes, words * 32, dtype=torch.bool)
        padded[:, :vocab] = bits
        weights = (padded.view(-1, words, 32).to(torch.int64) << torch.arange(32)).sum(-1)
        bitmask = torch.where(weights >= 2**31, weights - 2**32, weights).to(torch.int32)
        masked = torch.tensor([r % 3 != 0 for r in range(batch * nodes)])  # some rows unconstrained
        grammar = (bitmask, masked)
    coins = torch.rand(batch, nodes, generator=gen)
    rows = [(0.9, -1, 0.95, 0.0)] * batch
    walk_logits = logits.clone()
    if grammar is not None:  # as the verifier hands them over: masked in place, and the masks beside them
        apply_token_bitmask_(walk_logits, grammar[0], indices=grammar[1].nonzero()[:, 0].tolist())
    walked = _walk(walk_logits, tokens, parents, coins, rows, grammar)
    deepest = 0
    for b, (path, bonus) in enumerate(walked):
        committed = [int(tokens[b, n]) for n in path[1:]] + [bonus]
        for depth, node in enumerate(path):
            row = logits[b * nodes + node][None]
            g = None if grammar is None else (grammar[0][b * nodes + node][None], [bool(grammar[1][b * nodes + node])])
            drawn = sample_lists(row, [0.9], [-1], [0.95], [0.0], [float(coins[b, depth])], g)[0]
            assert drawn == committed[depth], (b, depth)
            if grammar is not None and grammar[1][b * nodes + node]:
                assert bits[b * nodes + node, drawn], (b, depth)  # the mask as the sampler reads it
            children = [c for c in range(node + 1, nodes) if int(parents[b, c]) == node]
            held = [c for c in children if int(tokens[b, c]) == drawn]
            assert (held[:1] == path[depth + 1:depth + 2]), (b, depth)
        deepest = max(deepest, len(path))
    assert deepest >= 4


def test_forbidden_tokens_are_never_committed_and_nan_rows_take_the_argmax():
    """A grammar-masked root (-inf outside a few tokens): neither an accepted child nor the bonus is ever a
    forbidden token; a row with a NaN has torch.argmax's answer as its whole distribution."""
    gen = torch.Generator().manual_seed(3)
    vocab, draws = 2_000, 400
    allowed = [5, 17, 900, 1999]
    root = torch.full((vocab,), -math.inf)
    root[allowed] = torch.tensor([1.0, 0.5, 2.0, -1.0])
    child_row = torch.randn(vocab, generator=gen)
    tokens = torch.tensor([[0, 900, 3]]).expand(draws, -1)  # the second child (token 3) is forbidden at the root
    parents = torch.tensor([[-1, 0, 0]]).expand(draws, -1)
    logits = torch.stack([root, child_row, child_row]).repeat(draws, 1)
    walked = _walk(logits, tokens, parents, torch.rand(draws, 3, generator=gen), [(0.9, -1, 0.95, 0.0)] * draws)
    assert all(path in ([0], [0, 1]) for path, _ in walked)
    assert all(bonus in allowed for path, bonus in walked if path == [0])
    assert {len(path) for path, _ in walked} == {1, 2}

    nan_row = torch.randn(1, vocab, generator=gen)
    nan_row[0, 321] = math.nan
    out = verify_trees_sampling_cpu(nan_row, [0], [[7]], [[-1]], [torch.tensor([0.5])], _params([(1.0, -1, 1.0, 0.0)]))
    assert out == [([0], 321)]


def test_bad_inputs_are_refused():
    ext = cpu_ops.extension()
    logits = torch.randn(3, 50)
    params = (torch.ones(1), torch.full((1,), -1, dtype=torch.int64), torch.ones(1), torch.zeros(1))
    good = dict(offsets=torch.tensor([0]), sizes=torch.tensor([3]), tokens=torch.tensor([1, 2, 3]),
                parents=torch.tensor([-1, 0, 1]), uniforms=torch.rand(3))

    def call(**changes):
        args = dict(good, **changes)
        return ext.verify_tree_sample(logits, args["offsets"], args["sizes"], args["tokens"], args["parents"],
                                      args["uniforms"], *params)

    call()
    for changes, message in [
        (dict(tokens=torch.tensor([1, 2, 50])), "outside the vocabulary"),
        (dict(parents=torch.tensor([-1, 0, 2])), "earlier node"),
        (dict(parents=torch.tensor([0, 0, 1])), "earlier node"),
        (dict(offsets=torch.tensor([1])), "outside the logits"),
        (dict(offsets=torch.tensor([2 ** 63 - 1])), "outside the logits"),  # offset + size wraps around
        (dict(sizes=torch.tensor([2 ** 62])), "root"),
        (dict(sizes=torch.tensor([0]), tokens=torch.tensor([], dtype=torch.int64),
              parents=torch.tensor([], dtype=torch.int64), uniforms=torch.rand(0)), "root"),
        (dict(uniforms=torch.rand(3, dtype=torch.float64)), "uniforms"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            call(**changes)
    with pytest.raises(RuntimeError, match="not sampled"):
        ext.verify_tree_sample(logits, good["offsets"], good["sizes"], good["tokens"], good["parents"],
                               good["uniforms"], torch.zeros(1), *params[1:])
