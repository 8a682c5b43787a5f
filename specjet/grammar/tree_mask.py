"""Grammar masks for a draft tree: which nodes are legal, and what may follow each node.

Speculative decoding verifies a whole tree of draft tokens in one target forward. For a request
under a grammar, the target's prediction after node i must be masked with the grammar state
reached by the path root..i, not with the root's state: then the greedy walk and the sampled
draws see exactly the distribution plain constrained decoding samples from, node by node.
xgrammar computes every node's mask in one walk over the tree (`traverse_draft_tree`), and a node
whose token its parent's mask forbids can never be accepted, so it and its subtree are dropped
before verification instead of costing the target a row.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specjet.grammar.matcher import RequestGrammar, allocate_token_bitmask


@dataclass
class TreeMasks:
    legal: list[bool]  # per node: every token on the path root..node is allowed by the grammar
    bitmask: torch.Tensor  # [N, W] int32: row i = tokens allowed after node i (legal nodes only)


def mask_draft_tree(grammar: RequestGrammar, tokens: list[int], parents: list[int], vocab_size: int) -> TreeMasks:
    """Per-node grammar masks of a draft tree whose root token `grammar` has already accepted.

    The grammar's state is the same afterwards. A legal node after which the grammar allows
    nothing (it took the stop token) gets an all-allowed row: the scheduler finishes the request
    at the stop token and drops whatever follows, and an all-masked row would only turn the
    target's logits into NaN probabilities there.
    """
    n = len(tokens)
    next_token, next_sibling = first_child_next_sibling(parents)
    bitmask = allocate_token_bitmask(n, vocab_size)
    arrays = torch.tensor([next_token, next_sibling, tokens], dtype=torch.int64)
    grammar.fill_draft_tree_bitmask(arrays[0], arrays[1], arrays[2], bitmask)
    # Legal iff the parent is legal and its row allows the token (a few dozen nodes: host ints beat
    # tensor ops). Rows below an illegal node were not written by the walk; they are not read.
    words = bitmask.numpy().view(np.uint32)
    legal = [True] * n
    for i in range(1, n):
        t = tokens[i]
        legal[i] = legal[parents[i]] and bool((int(words[parents[i], t >> 5]) >> (t & 31)) & 1)
    dead_end = ~words.any(axis=1)
    if dead_end.any():
        bitmask[torch.from_numpy(dead_end)] = -1
    return TreeMasks(legal, bitmask)


def first_child_next_sibling(parents: list[int]) -> tuple[list[int], list[int]]:
    """kernels/tree.py ``traversal_arrays`` of one tree on the host: each node's first child and next
    sibling (-1 = none), parents before children."""
    n = len(parents)
    first, after, last = [-1] * n, [-1] * n, [-1] * n
    for j in range(1, n):
        p = parents[j]
        if first[p] < 0:
            first[p] = j
        else:
            after[last[p]] = j
        last[p] = j
    return first, after
