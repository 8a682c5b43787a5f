"""Grammar masks for a draft tree: which nodes are legal, and what may follow each node.

Speculative decoding verifies a whole tree of draft tokens in one target forward. For a request
under a grammar, the target's prediction after node i must be masked with the grammar state
reached by the path root..i, not with the root's state: then the greedy walk and the rejection
sampling see exactly the distribution plain constrained decoding samples from, node by node.
xgrammar computes every node's mask in one walk over the tree (`traverse_draft_tree`), and a node
whose token its parent's mask forbids can never be accepted, so it and its subtree are dropped
before verification instead of costing the target a row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specjet.grammar.matcher import RequestGrammar, allocate_token_bitmask
from specjet.kernels.tree import traversal_arrays


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
    parent_ids = torch.tensor(parents, dtype=torch.int64)
    next_token, next_sibling = traversal_arrays(parent_ids[None])
    bitmask = allocate_token_bitmask(n, vocab_size)
    token_ids = torch.tensor(tokens, dtype=torch.int64)
    grammar.fill_draft_tree_bitmask(next_token[0], next_sibling[0], token_ids, bitmask)
    # Legal iff the parent is legal and its row allows the token. Rows below an illegal node were
    # not written by the walk; they are only read here for nodes already known to be illegal.
    parent_rows = parent_ids.clamp(min=0)
    words = bitmask[parent_rows, token_ids >> 5].to(torch.int64)
    allowed = ((words >> (token_ids & 31)) & 1).bool().tolist()
    legal = [True] * n
    for i in range(1, n):
        legal[i] = legal[parents[i]] and allowed[i]
    dead_end = ~bitmask.any(dim=1)
    bitmask[dead_end] = -1
    return TreeMasks(legal, bitmask)
