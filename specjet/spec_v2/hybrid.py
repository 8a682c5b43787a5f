"""The EAGLE + n-gram hybrid (specjet's own): each request's EAGLE tree (or DFLASH block) also holds
its best n-gram continuation, merged under the same root and verified as one tree.

The learned head is good at prose and at the first tokens of a value; the request's own text is
better at what repeats (JSON keys, records of an array, copied spans), often a dozen tokens at a
time. The n-gram path goes first in the merged tree, then the learned tree's nodes it lacks; its
length adapts per request (``PathLength``) because it costs verify nodes whether or not the target
takes it.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from specjet.spec_v2.drafter import DraftRequest, DraftTree, Drafter, SpecInput
from specjet.spec_v2.ngram import NgramDrafter
from specjet.spec_v2.tree_verifier import VerifyResult


class HybridDrafter:
    """A learned drafter's trees (EAGLE's or DFlash's) with each request's n-gram path merged in (a ``Drafter``)."""

    def __init__(self, learned: Drafter, ngram: NgramDrafter, max_path_nodes: int, max_tree_nodes: int):
        self.learned = learned  # the EAGLE or DFlash drafter
        self.ngram = ngram  # one branch: the path
        self.path_length = PathLength(max_path_nodes)
        self.max_tree_nodes = max_tree_nodes
        self.feature_capture = learned.feature_capture
        self.draft_kv_reads_next_token = learned.draft_kv_reads_next_token
        # Between propose and after_verify: each request's n-gram path (tokens under the root) and
        # how many of them are the forced chain it shares with the learned tree.
        self._paths: dict[str, tuple[list[int], int]] = {}

    def scratch_slots(self, batch_size: int) -> int:
        return self.learned.scratch_slots(batch_size)

    def after_prefill(self, reqs: list[SpecInput], hidden: torch.Tensor | None, first_tokens: list[int],
                      req_to_token: torch.Tensor) -> None:
        self.learned.after_prefill(reqs, hidden, first_tokens, req_to_token)

    def propose(self, reqs: list[DraftRequest], share: int, req_to_token: torch.Tensor) -> list[DraftTree]:
        ngram_reqs = []
        for r in reqs:  # the path's own length adapts, and shrinks with the tree's share of the verify
            limit = self.path_length.limit(r.input.rid)
            if share < self.max_tree_nodes:
                limit = max(1, limit * share // self.max_tree_nodes)
            ngram_reqs.append(replace(r, budget=min(r.budget, 1 + len(r.chain) + limit)))
        ngram_trees = self.ngram.propose(ngram_reqs, share, req_to_token)
        # The learned tree whole: the merge keeps what fits after the path (and applies the learned budget, so nodes
        # the path already holds leave room for the learned tree's next ones).
        learned = self.learned.propose([replace(r, budget=self.max_tree_nodes, learned_nodes=None) for r in reqs],
                                       share, req_to_token)
        trees = []
        for r, ngram_tree, tree in zip(reqs, ngram_trees, learned):
            path = first_path(*ngram_tree)
            self._paths[r.input.rid] = (path, len(r.chain) if path[:len(r.chain)] == r.chain else 0)
            # Learned nodes only up to the request's learned budget; the path (and forced chain) may pass it.
            trees.append(merge_trees(ngram_tree, tree, max(len(ngram_tree[0]), r.learned_budget())))
        return trees

    def after_verify(self, reqs: list[SpecInput], result: VerifyResult, req_to_token: torch.Tensor) -> None:
        for req, accepted in zip(reqs, result.accepted_tokens):
            path, shared = self._paths.pop(req.rid)
            taken = next((i for i, (a, b) in enumerate(zip(path, accepted)) if a != b), min(len(path), len(accepted)))
            self.path_length.update(req.rid, len(path) - shared, max(0, taken - shared))
        self.learned.after_verify(reqs, result, req_to_token)

    def release(self, rid: str) -> None:
        self.ngram.release(rid)
        self.path_length.release(rid)
        self._paths.pop(rid, None)
        self.learned.release(rid)


def merge_trees(first: tuple[list[int], list[int]], second: tuple[list[int], list[int]], max_nodes: int
                ) -> tuple[list[int], list[int]]:
    """The union of two draft trees under the same root, as one tree of at most ``max_nodes``
    nodes: ``first``'s nodes in its order, then ``second``'s that it lacks (a node whose path
    ``first`` already has is that node, so its subtree hangs there). Both trees list parents before
    children, and so does the result: any prefix of it is a tree."""
    tokens, parents = first[0][:max_nodes], first[1][:max_nodes]
    if second[0][0] != tokens[0]:
        raise ValueError(f"trees with different roots ({tokens[0]} vs {second[0][0]}) cannot be merged")
    tokens, parents = list(tokens), list(parents)
    node_of = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents)) if i}
    mapped = {0: 0}  # second's node -> the result's
    for j in range(1, len(second[0])):
        parent = mapped.get(second[1][j])
        if parent is None:  # its parent did not fit
            continue
        key = (parent, second[0][j])
        node = node_of.get(key)
        if node is None:
            if len(tokens) >= max_nodes:
                continue
            node = node_of[key] = len(tokens)
            tokens.append(second[0][j])
            parents.append(parent)
        mapped[j] = node
    return tokens, parents


class PathLength:
    """How many tokens each request's hybrid n-gram path may have: half of ``max_len`` as a rule, up to
    all of it while its paths keep being taken whole.

    The path costs verify nodes whether or not the target takes it. On repetitive text (a JSON array
    of records, repeated keys and values) it is right a dozen tokens at a time; on prose it is right
    now and then, for a few tokens, and a longer guess there only makes the verify dearer. So a
    request's limit doubles (up to ``max_len``) each time its path is taken whole at the limit, and
    after a miss drops to one past what was taken, but by half at most and never below the rule.
    That way repetitive output gets the accept length of a long path and prose the cheaper verify of
    a short one (bench/RESULTS.md compares it with fixed lengths)."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.min_len = max(1, max_len // 2)
        self._limits: dict[str, int] = {}

    def limit(self, rid: str) -> int:
        return self._limits.get(rid, self.min_len)

    def update(self, rid: str, proposed: int, taken: int) -> None:
        """After a verify: the path had ``proposed`` tokens (beyond any forced chain) and the target
        took the first ``taken``. No path, nothing learned."""
        if proposed <= 0:
            return
        limit = self.limit(rid)
        if taken >= proposed:
            if proposed >= limit:  # taken whole at the limit: try longer (a match that ran out says nothing)
                self._limits[rid] = min(self.max_len, 2 * limit)
        else:
            self._limits[rid] = max(self.min_len, taken + 1, limit // 2)

    def release(self, rid: str) -> None:
        self._limits.pop(rid, None)


def first_path(tokens: list[int], parents: list[int]) -> list[int]:
    """The tokens of a tree's first root-to-leaf path, root left out: node 1, its first child, ... (in a
    trie from ``build_trie`` that is its first branch)."""
    path, node = [], 0
    for i in range(1, len(tokens)):
        if parents[i] == node:
            path.append(tokens[i])
            node = i
    return path


