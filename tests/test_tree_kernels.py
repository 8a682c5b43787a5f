"""Draft-tree kernels (torch references): tree tensors, EAGLE-2 rerank, greedy and sampling
verification.

The oracles are a tree worked out by hand, plain-Python walks over parent lists that share no code
with the vectorised references, and, for the sampling verifier, the target distribution itself:
20k+ seeded draws must reproduce it, and deliberately biased verifiers must fail the same check.
"""
from __future__ import annotations

import math

import pytest
import torch

from specjet.kernels.tree import build_tree, flatten_expansion_steps, select_draft_nodes, traversal_arrays
from specjet.kernels.tree_verify import verify_tree_greedy, verify_tree_sampling

# --- shared random inputs (also used by test_triton_tree.py) --------------------------------


def random_parents(batch: int, num_nodes: int, gen: torch.Generator, chain_bias: float = 0.5) -> torch.Tensor:
    """[B, N] random trees: each node's parent is a random earlier node, or with probability
    ``chain_bias`` the node just before it (so some trees are deep)."""
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for b in range(batch):
        for i in range(1, num_nodes):
            if torch.rand((), generator=gen) < chain_bias:
                parents[b, i] = i - 1
            else:
                parents[b, i] = int(torch.randint(0, i, (), generator=gen))
    return parents


def children_lists(parents: list[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def targets_following_tree(parents: torch.Tensor, tokens: torch.Tensor, vocab: int, gen: torch.Generator,
                           follow: float = 0.8) -> torch.Tensor:
    """[B, N] target argmaxes that pick one of the node's children (a random one) with probability
    ``follow`` and a random token otherwise, so greedy paths run deep."""
    batch, num_nodes = parents.shape
    target = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    for b in range(batch):
        for node, kids in enumerate(children_lists(parents[b].tolist())):
            if kids and torch.rand((), generator=gen) < follow:
                target[b, node] = tokens[b, kids[int(torch.randint(0, len(kids), (), generator=gen))]]
    return target


def probs_favouring_children(parents: torch.Tensor, tokens: torch.Tensor, vocab: int, gen: torch.Generator,
                             top_k: int = 0) -> torch.Tensor:
    """[B, N, V] target distributions with extra mass on each node's children's tokens, so sampled
    paths run deep; with ``top_k`` only the k likeliest tokens keep mass (zeros elsewhere)."""
    batch, num_nodes = parents.shape
    logits = torch.randn(batch, num_nodes, vocab, generator=gen)
    for b in range(batch):
        for node, kids in enumerate(children_lists(parents[b].tolist())):
            for kid in kids:
                # log(V) puts a child on a par with the rest of the vocab together.
                logits[b, node, tokens[b, kid]] += math.log(vocab) + 2.0 * float(torch.rand((), generator=gen))
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


# --- plain-Python oracles --------------------------------------------------------------------


def naive_tree(parents: list[int], seq_len: int) -> dict:
    num_nodes = len(parents)
    ancestors = []
    for node in range(num_nodes):
        chain, a = [], node
        while a != -1:
            chain.append(a)
            a = parents[a]
        ancestors.append(chain)
    children = children_lists(parents)
    next_sibling = []
    for node, parent in enumerate(parents):
        later = [s for s in children[parent] if s > node] if parent >= 0 else []
        next_sibling.append(later[0] if later else -1)
    return dict(
        mask=[[j in ancestors[i] for j in range(num_nodes)] for i in range(num_nodes)],
        depths=[len(c) - 1 for c in ancestors],
        positions=[seq_len + len(c) - 1 for c in ancestors],
        retrive_next_token=[kids[0] if kids else -1 for kids in children],
        retrive_next_sibling=next_sibling,
    )


def naive_greedy(parents: list[int], tokens: list[int], target: list[int]) -> tuple[list[int], int]:
    """SGLang's traversal: from the root, scan the children in order via first-child/next-sibling."""
    children = children_lists(parents)
    path, cur = [0], 0
    while True:
        nxt = next((c for c in children[cur] if tokens[c] == target[cur]), None)
        if nxt is None:
            return path, target[cur]
        path.append(nxt)
        cur = nxt


def naive_inverse_cdf(weights: list[float], u: float) -> int:
    total = sum(weights)
    if total <= 0:
        return -1
    acc = 0.0
    for token, w in enumerate(weights):
        acc += w
        if acc > u * total:
            return token
    return max(t for t, w in enumerate(weights) if w > 0)


def naive_sampling(parents: list[int], tokens: list[int], probs: list[list[float]], coins: list[float],
                   bias: str | None = None) -> tuple[list[int], int]:
    """The verifier's rule written out literally: at the current node (depth d) draw its token by the inverse
    CDF of its row at coins[d], as plain decoding would; move to the first child holding that token, else end
    with it as the bonus. ``bias`` makes deliberately wrong variants: "first_child_always" accepts the first child
    unconditionally; "one_coin" draws every depth with the root's coin (plain decoding's coins are independent)."""
    children = children_lists(parents)
    path, cur = [0], 0
    while True:
        depth = len(path) - 1
        drawn = naive_inverse_cdf(probs[cur], coins[0 if bias == "one_coin" else depth])
        if bias == "first_child_always" and children[cur]:
            nxt = children[cur][0]
        else:
            nxt = next((c for c in children[cur] if tokens[c] == drawn), None)
        if nxt is None:
            return path, drawn
        path.append(nxt)
        cur = nxt


# --- build_tree ------------------------------------------------------------------------------

# Request 0, by hand:      root(0)            Request 1: a chain 0 <- 1 <- 2 <- 3 <- 4 <- 5
#                          /     \
#                        a(1)    b(2)
#                        /  \
#                     c(3)  d(4)
#                      |
#                     e(5)
HAND_PARENTS = [[-1, 0, 0, 1, 1, 3], [-1, 0, 1, 2, 3, 4]]
HAND_SEQ_LENS = [10, 3]
HAND_TOKENS = [[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]]


def test_build_tree_by_hand():
    tree = build_tree(torch.tensor(HAND_PARENTS), torch.tensor(HAND_SEQ_LENS))
    T, F = True, False
    assert tree.mask.dtype == torch.bool
    assert tree.mask[0].tolist() == [
        [T, F, F, F, F, F],  # root
        [T, T, F, F, F, F],  # a: root, a
        [T, F, T, F, F, F],  # b: root, b
        [T, T, F, T, F, F],  # c: root, a, c
        [T, T, F, F, T, F],  # d: root, a, d
        [T, T, F, T, F, T],  # e: root, a, c, e
    ]
    assert tree.mask[1].tolist() == [[j <= i for j in range(6)] for i in range(6)]  # a chain is causal
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert tree.positions.tolist() == [[10, 11, 11, 12, 12, 13], [3, 4, 5, 6, 7, 8]]
    assert tree.retrive_index.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert tree.retrive_next_token.tolist() == [[1, 3, -1, 5, -1, -1], [1, 2, 3, 4, 5, -1]]
    assert tree.retrive_next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1], [-1, -1, -1, -1, -1, -1]]
    assert tree.max_depth == 5
    for name in ("depths", "positions", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        assert getattr(tree, name).dtype == torch.int64, name
    # A static bound from the drafter is kept as given.
    assert build_tree(torch.tensor(HAND_PARENTS), torch.tensor(HAND_SEQ_LENS), max_depth=7).max_depth == 7


@pytest.mark.parametrize("batch,num_nodes", [(1, 1), (4, 6), (3, 17), (2, 64)])
def test_build_tree_matches_naive(batch, num_nodes):
    gen = torch.Generator().manual_seed(num_nodes)
    parents = random_parents(batch, num_nodes, gen)
    seq_lens = torch.randint(0, 500, (batch,), generator=gen)
    tree = build_tree(parents, seq_lens)
    for b in range(batch):
        expected = naive_tree(parents[b].tolist(), int(seq_lens[b]))
        for name, value in expected.items():
            assert getattr(tree, name)[b].tolist() == value, (b, name)
    assert tree.max_depth == int(tree.depths.max())


def test_build_tree_rejects_bad_parents():
    with pytest.raises(ValueError):
        build_tree(torch.tensor([[-1, 0, 2]]), torch.tensor([0]))  # node 2 is its own parent
    with pytest.raises(ValueError):
        build_tree(torch.tensor([[0, 0, 1]]), torch.tensor([0]))  # node 0 is not a root
    with pytest.raises(ValueError):
        build_tree(torch.tensor(HAND_PARENTS), torch.tensor(HAND_SEQ_LENS), max_depth=2)


@pytest.mark.parametrize("num_nodes", [1, 2, 9, 33])
def test_the_host_traversal_of_one_tree_equals_traversal_arrays(num_nodes):
    """grammar/tree_mask.py walks a verify tree's first children and next siblings on the host."""
    from specjet.grammar.tree_mask import first_child_next_sibling

    gen = torch.Generator().manual_seed(num_nodes)
    for chain_bias in (0.0, 0.5, 1.0):
        parents = random_parents(4, num_nodes, gen, chain_bias)
        first, after = traversal_arrays(parents)
        for row in range(4):
            assert first_child_next_sibling(parents[row].tolist()) == (first[row].tolist(), after[row].tolist())


def test_traversal_arrays_drive_xgrammar():
    """The per-request rows are what xgrammar's traverse_draft_tree consumes: row i of its bitmask
    is the mask after node i's path (the root's token is already in the matcher)."""
    xgr = pytest.importorskip("xgrammar")
    vocab = ["a", "b", "c", "d", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[4])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar('root ::= "a" ("b" "c" | "c" "d")'))
    # root -> a -> {b -> c, c -> d}, plus a wrong sibling "d" after a.
    parents = torch.tensor([[-1, 0, 1, 1, 1, 2, 3]])
    tokens = torch.tensor([[4, 0, 1, 2, 3, 2, 3]])
    tree = build_tree(parents, torch.tensor([7]))
    bitmask = xgr.allocate_token_bitmask(7, info.vocab_size)
    assert matcher.traverse_draft_tree(tree.retrive_next_token[0], tree.retrive_next_sibling[0], tokens[0], bitmask)
    allowed = [[v for v in range(len(vocab)) if (int(bitmask[i, 0]) >> v) & 1] for i in range(3)]
    assert allowed[0] == [0]  # after the root: "a"
    assert allowed[1] == [1, 2]  # after "a": "b" or "c"
    assert allowed[2] == [2]  # after "ab": "c"


# --- select_draft_nodes ----------------------------------------------------------------------

# topk = 2, num_steps = 3, root token 100. Cumulative path probabilities, written as literals:
#   step 0 (root):       A=10 .6     B=11 .3
#   step 1 (A, B):       A -> C=20 .36  D=21 .12     B -> E=22 .27  F=23 .015
#   step 2 (C, E):       C -> G=30 .288 H=31 .036    E -> I=32 .27 (ties its parent E)  J=33 .0027
# Flat candidate indices: A0 B1 | C2 D3 E4 F5 | G6 H7 I8 J9.
# Rank: A .6, C .36, B .3, G .288, E .27, I .27 (the tie goes to E, the ancestor), D, H, F, J.
STEP_TOKENS = [torch.tensor([[[10, 11]]]), torch.tensor([[[20, 21], [22, 23]]]), torch.tensor([[[30, 31], [32, 33]]])]
STEP_SCORES = [torch.tensor([[[0.6, 0.3]]]), torch.tensor([[[0.36, 0.12], [0.27, 0.015]]]),
               torch.tensor([[[0.288, 0.036], [0.27, 0.0027]]])]
FRONTIERS = [torch.tensor([[0, 1]]), torch.tensor([[0, 2]])]  # step 2 expands step 1's C (0) and E (2)


def test_flatten_expansion_steps():
    tokens, parents, scores = flatten_expansion_steps(STEP_TOKENS, STEP_SCORES, FRONTIERS)
    assert tokens.tolist() == [[10, 11, 20, 21, 22, 23, 30, 31, 32, 33]]
    assert parents.tolist() == [[-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]]
    assert scores.shape == (1, 10)


@pytest.mark.parametrize("log_scores", [False, True])
def test_select_draft_nodes_by_hand(log_scores):
    cand_tokens, cand_parents, cand_scores = flatten_expansion_steps(STEP_TOKENS, STEP_SCORES, FRONTIERS)
    if log_scores:
        cand_scores = cand_scores.log()
    root = torch.tensor([100])
    tokens, parents = select_draft_nodes(root, cand_tokens, cand_parents, cand_scores, num_draft_tokens=7)
    # Nodes in rank order: 1 A, 2 C, 3 B, 4 G, 5 E, 6 I.
    assert tokens.tolist() == [[100, 10, 20, 11, 30, 22, 32]]
    assert parents.tolist() == [[-1, 0, 1, 0, 2, 3, 5]]
    # One node fewer: E and I tie for the last place; E, the ancestor, wins.
    tokens, parents = select_draft_nodes(root, cand_tokens, cand_parents, cand_scores, num_draft_tokens=6)
    assert tokens.tolist() == [[100, 10, 20, 11, 30, 22]]
    assert parents.tolist() == [[-1, 0, 1, 0, 2, 3]]
    build_tree(parents, torch.tensor([0]))  # a valid tree


def test_select_draft_nodes_keeps_ancestors_of_a_child_that_outscores_its_parent():
    # Candidate 1 (child of 0) scores above its parent: ranked by its path minimum, it cannot enter
    # without candidate 0.
    cand_tokens = torch.tensor([[5, 6, 7]])
    cand_parents = torch.tensor([[-1, 0, -1]])
    cand_scores = torch.tensor([[0.2, 0.9, 0.5]])
    tokens, parents = select_draft_nodes(torch.tensor([1]), cand_tokens, cand_parents, cand_scores, 3)
    assert tokens.tolist() == [[1, 7, 5]]
    assert parents.tolist() == [[-1, 0, 0]]
    tokens, parents = select_draft_nodes(torch.tensor([1]), cand_tokens, cand_parents, cand_scores, 4)
    assert tokens.tolist() == [[1, 7, 5, 6]]
    assert parents.tolist() == [[-1, 0, 0, 2]]


def naive_select(root: int, tokens: list[int], parents: list[int], scores: list[float], num_draft_tokens: int):
    def path_min(m):
        best = scores[m]
        while parents[m] >= 0:
            m = parents[m]
            best = min(best, scores[m])
        return best

    ranked = sorted(range(len(tokens)), key=lambda m: (-path_min(m), m))[: num_draft_tokens - 1]
    new_index = {m: r + 1 for r, m in enumerate(ranked)}
    return [root] + [tokens[m] for m in ranked], [-1] + [0 if parents[m] < 0 else new_index[parents[m]] for m in ranked]


def test_select_draft_nodes_matches_naive_on_random_expansions():
    gen = torch.Generator().manual_seed(3)
    batch, topk, num_steps, num_draft_tokens = 6, 3, 4, 12
    # A real EAGLE-2 expansion: probabilities multiply along paths; frontiers are the step's top-k.
    step_tokens, step_scores, frontiers = [], [], []
    frontier_scores = torch.ones(batch, 1)
    for step in range(num_steps):
        width = frontier_scores.shape[1]
        child_probs = torch.softmax(torch.randn(batch, width, 50, generator=gen) * 2, -1)
        # Quantised probabilities make exact ties (including child == parent via p = 1) likely.
        child_probs = (child_probs * 8).round() / 8
        p, tok = child_probs.topk(topk, dim=-1)
        scores = frontier_scores[:, :, None] * p
        step_tokens.append(tok)
        step_scores.append(scores)
        top = scores.reshape(batch, -1).topk(topk, dim=-1)
        if step + 1 < num_steps:
            frontiers.append(top.indices)
        frontier_scores = top.values
    cand = flatten_expansion_steps(step_tokens, step_scores, frontiers)
    roots = torch.arange(batch) + 1000
    tokens, parents = select_draft_nodes(roots, *cand, num_draft_tokens)
    assert tokens.shape == parents.shape == (batch, num_draft_tokens)
    for b in range(batch):
        expected = naive_select(int(roots[b]), *(c[b].tolist() for c in cand), num_draft_tokens)
        assert (tokens[b].tolist(), parents[b].tolist()) == expected
    build_tree(parents, torch.zeros(batch, dtype=torch.int64))  # parents before children throughout


# --- greedy verification ---------------------------------------------------------------------


def hand_tree():
    return torch.tensor(HAND_TOKENS), build_tree(torch.tensor(HAND_PARENTS), torch.tensor(HAND_SEQ_LENS))


def test_verify_greedy_by_hand():
    tokens, tree = hand_tree()
    # Request 0 accepts root -> a -> c -> e (all the way down), bonus 99 after e.
    # Request 1 (chain) accepts 21, 22 and misses 23: bonus 77 after node 2.
    target = torch.tensor([[11, 13, 0, 15, 0, 99], [21, 22, 77, 0, 0, 0]])
    path, lens, bonus = verify_tree_greedy(tokens, tree, target)
    assert path.tolist() == [[0, 1, 3, 5, -1, -1], [0, 1, 2, -1, -1, -1]]
    assert lens.tolist() == [4, 3]
    assert bonus.tolist() == [99, 77]
    # Partial via the second sibling: root -> b (12), b is a leaf, bonus after b. Root-only: no match.
    target = torch.tensor([[12, 0, 55, 0, 0, 0], [66, 0, 0, 0, 0, 0]])
    path, lens, bonus = verify_tree_greedy(tokens, tree, target)
    assert path.tolist() == [[0, 2, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1]]
    assert lens.tolist() == [2, 1]
    assert bonus.tolist() == [55, 66]
    # Partial inside: root -> a -> d (the second child of a), bonus after d.
    target = torch.tensor([[11, 14, 0, 0, 44, 0], [21, 22, 23, 24, 25, 26]])
    path, lens, bonus = verify_tree_greedy(tokens, tree, target)
    assert path.tolist() == [[0, 1, 4, -1, -1, -1], [0, 1, 2, 3, 4, 5]]
    assert lens.tolist() == [3, 6]
    assert bonus.tolist() == [44, 26]


@pytest.mark.parametrize("batch,num_nodes", [(8, 6), (8, 25), (3, 1)])
def test_verify_greedy_matches_naive(batch, num_nodes):
    gen = torch.Generator().manual_seed(num_nodes)
    vocab = 20
    parents = random_parents(batch, num_nodes, gen)
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    target = targets_following_tree(parents, tokens, vocab, gen)
    tree = build_tree(parents, torch.zeros(batch, dtype=torch.int64))
    path, lens, bonus = verify_tree_greedy(tokens, tree, target)
    assert path.shape == (batch, tree.max_depth + 1)
    for b in range(batch):
        exp_path, exp_bonus = naive_greedy(parents[b].tolist(), tokens[b].tolist(), target[b].tolist())
        assert path[b].tolist() == exp_path + [-1] * (tree.max_depth + 1 - len(exp_path))
        assert int(lens[b]) == len(exp_path)
        assert int(bonus[b]) == exp_bonus
    if num_nodes > 1:
        assert int(lens.max()) > 2  # the targets make some paths run deep


# --- sampling verification -------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 3])
def test_verify_sampling_matches_naive_rule(top_k):
    """Same coins, same decisions: the vectorised verifier against the literal sequential rule."""
    gen = torch.Generator().manual_seed(11 + top_k)
    batch, num_nodes, vocab = 300, 12, 10  # a small vocab: siblings sometimes repeat a token
    parents = random_parents(batch, num_nodes, gen)
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    probs = probs_favouring_children(parents, tokens, vocab, gen, top_k=top_k)
    coins = torch.rand(batch, num_nodes, generator=gen)
    tree = build_tree(parents, torch.zeros(batch, dtype=torch.int64))
    path, lens, bonus = verify_tree_sampling(tokens, tree, probs, coins)
    for b in range(batch):
        exp_path, exp_bonus = naive_sampling(parents[b].tolist(), tokens[b].tolist(), probs[b].double().tolist(),
                                             coins[b].tolist())
        assert path[b].tolist() == exp_path + [-1] * (tree.max_depth + 1 - len(exp_path)), b
        assert int(lens[b]) == len(exp_path)
        assert int(bonus[b]) == exp_bonus, b
    assert int(lens.max()) >= 4


def test_verify_sampling_with_one_hot_targets_is_greedy():
    gen = torch.Generator().manual_seed(5)
    batch, num_nodes, vocab = 16, 20, 30
    parents = random_parents(batch, num_nodes, gen)
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    target = targets_following_tree(parents, tokens, vocab, gen)
    tree = build_tree(parents, torch.zeros(batch, dtype=torch.int64))
    one_hot = torch.nn.functional.one_hot(target, vocab).float()
    sampled = verify_tree_sampling(tokens, tree, one_hot, torch.rand(batch, num_nodes, generator=gen))
    greedy = verify_tree_greedy(tokens, tree, target)
    for got, want in zip(sampled, greedy):
        assert torch.equal(got, want)


# A 2-level tree over a 6-token vocab:   root ─┬─ x1 (token 2) ─┬─ (token 1)
#                                              │                └─ (token 3)
#                                              └─ x2 (token 4) ─── (token 0)
DIST_PARENTS = [-1, 0, 0, 1, 1, 2]
DIST_TOKENS = [5, 2, 4, 1, 3, 0]
DIST_PROBS = [
    [0.05, 0.10, 0.45, 0.10, 0.25, 0.05],  # after the root: its children hold 0.45 and 0.25
    [0.10, 0.40, 0.05, 0.30, 0.05, 0.10],  # after x1
    [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],  # after x2
    [0.20, 0.10, 0.30, 0.10, 0.20, 0.10],
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
    [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
]
NUM_DRAWS = 40_000  # the rarest conditional below still gets ~10k draws, a TV noise of ~0.01
TV_BOUND = 0.02


def committed_tokens(path: list[int], bonus: int) -> list[int]:
    return [DIST_TOKENS[n] for n in path[1:]] + [bonus]


def tv_distance_report(draws: list[list[int]]) -> dict:
    """TV distance between the empirical distribution and the target: of the first committed token,
    and of the second given a first that is a child of the root (then drawn after that child)."""
    def tv(samples: list[int], probs: list[float]) -> float:
        if not samples:  # the condition never happened, though the target gives it >= 25%
            return 1.0
        counts = [0] * len(probs)
        for s in samples:
            counts[s] += 1
        return 0.5 * sum(abs(c / len(samples) - p) for c, p in zip(counts, probs))

    report = {"first": tv([d[0] for d in draws], DIST_PROBS[0])}
    for child in (1, 2):
        seconds = [d[1] for d in draws if d[0] == DIST_TOKENS[child]]
        report[f"second_after_node{child}"] = tv(seconds, DIST_PROBS[child])
    return report


def distribution_coins(seed: int) -> torch.Tensor:
    return torch.rand(NUM_DRAWS, len(DIST_PARENTS), generator=torch.Generator().manual_seed(seed))


def test_verify_sampling_reproduces_target_distribution():
    coins = distribution_coins(0)
    parents = torch.tensor([DIST_PARENTS]).expand(NUM_DRAWS, -1)
    tokens = torch.tensor([DIST_TOKENS]).expand(NUM_DRAWS, -1)
    probs = torch.tensor([DIST_PROBS]).expand(NUM_DRAWS, -1, -1)
    tree = build_tree(parents, torch.zeros(NUM_DRAWS, dtype=torch.int64))
    path, lens, bonus = verify_tree_sampling(tokens, tree, probs, coins)
    draws = [committed_tokens(p[:n], int(x)) for p, n, x in zip(path.tolist(), lens.tolist(), bonus)]
    report = tv_distance_report(draws)
    assert all(v < TV_BOUND for v in report.values()), report
    # Both children and the bonus path are exercised.
    assert 0.3 < float((lens >= 2).float().mean()) < 0.9


@pytest.mark.parametrize("bias", ["first_child_always", "one_coin"])
def test_biased_verifiers_fail_the_distribution_check(bias):
    """The check above has the power to catch a biased verifier."""
    coins = distribution_coins(0).tolist()
    draws = [committed_tokens(*naive_sampling(DIST_PARENTS, DIST_TOKENS, DIST_PROBS, c, bias=bias)) for c in coins]
    report = tv_distance_report(draws)
    assert max(report.values()) > 5 * TV_BOUND, report
    # ...while the unbiased literal rule passes it on the same coins.
    draws = [committed_tokens(*naive_sampling(DIST_PARENTS, DIST_TOKENS, DIST_PROBS, c)) for c in coins]
    report = tv_distance_report(draws)
    assert all(v < TV_BOUND for v in report.values()), report


def test_verify_sampling_root_only_tree_is_plain_sampling():
    """With no draft nodes the bonus is an inverse-CDF draw from the root's distribution."""
    probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4]]]).expand(4, 1, 4)
    tree = build_tree(torch.full((4, 1), -1), torch.zeros(4, dtype=torch.int64))
    coins = torch.tensor([[0.05], [0.25], [0.55], [0.95]])
    path, lens, bonus = verify_tree_sampling(torch.zeros(4, 1, dtype=torch.int64), tree, probs, coins)
    assert path.tolist() == [[0]] * 4
    assert lens.tolist() == [1] * 4
    assert bonus.tolist() == [0, 1, 2, 3]


def test_verify_sampling_takes_each_depths_draw_by_hand():
    """The root's row lives on its two children's tokens: the root's coin picks one (the inverse CDF at 0.7), and
    the child's own coin draws the bonus after it; the second depth's coin is never the first's."""
    probs = torch.tensor([[[0.0, 0.7, 0.3], [1 / 3, 1 / 3, 1 / 3], [0.0, 0.0, 1.0]]])
    tree = build_tree(torch.tensor([[-1, 0, 0]]), torch.tensor([0]))
    tokens = torch.tensor([[0, 1, 2]])
    for coin0, coin1, want_node, want_bonus in [(0.0, 0.0, 1, 0), (0.69, 0.5, 1, 1), (0.7, 0.9, 2, 2),
                                                 (1 - 2**-24, 0.1, 2, 2), (0.2, 0.99, 1, 2)]:
        coins = torch.tensor([[coin0, coin1, 0.5]])
        path, lens, bonus = verify_tree_sampling(tokens, tree, probs, coins)
        assert path[0].tolist() == [0, want_node] and int(lens[0]) == 2, (coin0, coin1)
        assert int(bonus[0]) == want_bonus, (coin0, coin1)


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(pytest.main([__file__, "-q"]))


def random_tree(gen: torch.Generator, n: int) -> tuple[list[int], list[int]]:
    """A draft tree of n nodes over a 6-token vocabulary (so siblings often share tokens)."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
    return [int(t) for t in torch.randint(0, 6, (n,), generator=gen)], parents


def test_the_verifiers_host_greedy_walk_is_the_tensor_verifiers():
    """spec_v2/tree_verifier.py walks greedy verifies on host lists: the same path and bonus token as
    kernels/tree_verify.py's tensor verifier (the rule the Triton verifier shares) on random trees."""
    from specjet.kernels.tree import build_tree_reference
    from specjet.kernels.tree_verify import verify_tree_greedy_reference
    from specjet.spec_v2.tree_verifier import _greedy_path

    gen = torch.Generator().manual_seed(7)
    for trial in range(200):
        n = int(torch.randint(1, 20, (), generator=gen))
        tokens, parents = random_tree(gen, n)
        target = [int(t) for t in torch.randint(0, 6, (n,), generator=gen)]
        tree = build_tree_reference(torch.tensor([parents]), torch.tensor([0]))
        path, lens, bonus = verify_tree_greedy_reference(torch.tensor([tokens]), tree, torch.tensor([target]))
        assert _greedy_path(tokens, parents, target) == (path[0, :int(lens[0])].tolist(), int(bonus[0])), trial
