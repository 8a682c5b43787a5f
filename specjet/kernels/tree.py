"""Draft trees for EAGLE-style speculative decoding: choosing the nodes, and the tensors that
describe the tree to attention, to verification and to a grammar matcher.

Conventions shared with ``tree_verify.py`` and ``TreeInfo`` (``tree_info.py``). A batch holds B
requests, each with a tree of exactly N nodes (N = num_draft_tokens). Node 0 is the ROOT: the last
verified token, whose KV is not yet written, fed to the verify forward like the other nodes. Every
other node has a parent with a smaller index, so the index order is a topological order, and the
children of a node appear in index order best draft score first. ``parents[b, i]`` is -1 for the root.

The traversal arrays use SGLang's names (``retrive_*``, sic) and its per-request layout, which is
also what xgrammar's ``GrammarMatcher.traverse_draft_tree(retrieve_next_token,
retrieve_next_sibling, draft_tokens, token_bitmask)`` consumes: for one request pass
``tree.retrive_next_token[b]``, ``tree.retrive_next_sibling[b]`` and ``tokens[b]`` (1-D int64,
node-local indices, -1 = none; on the CPU, where xgrammar works); row i of its bitmask is then the
mask for the token after node i, and the root's own token is taken as already accepted.
"""
from __future__ import annotations

import math

import torch

from specjet.kernels.tree_info import TreeInfo


def _check(ok: torch.Tensor | bool, message: str) -> None:
    """Check an input invariant where it costs nothing: on CUDA, reading the flag back would stall
    the stream, so the check is left to the CPU runs (tests, CPU serving)."""
    if isinstance(ok, torch.Tensor):
        if ok.is_cuda:
            return
        ok = bool(ok.all())
    if not ok:
        raise ValueError(message)


# --- EAGLE-2 rerank -------------------------------------------------------------------------


def flatten_expansion_steps(
    step_tokens: list[torch.Tensor],
    step_scores: list[torch.Tensor],
    frontiers: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn an EAGLE-2 drafter's per-step outputs into the flat candidate layout of
    ``select_draft_nodes`` (this mirrors SGLang's ``score_list``/``token_list``/``parents_list``).

    Step s expands F_s frontier nodes (F_0 = 1: the root) into their top-``topk`` children each:
      step_tokens[s]: [B, F_s, topk] token ids of those children, best first within a parent;
      step_scores[s]: [B, F_s, topk] their cumulative path scores (see ``select_draft_nodes``);
      frontiers[s - 1] (s >= 1): [B, F_s] which node frontier slot f of step s expands, as an index
        into step s-1's candidates flattened in (frontier slot, child rank) order, i.e.
        ``f' * topk + c`` for step s-1's slot f' and child rank c.
    So ``len(frontiers) == len(step_tokens) - 1``. Candidates come out in step order, then
    frontier slot, then child rank: M = sum_s F_s * topk of them, every parent before its children.

    Returns (cand_tokens [B, M], cand_parents [B, M] int64 with -1 = child of the root,
    cand_scores [B, M]).
    """
    assert len(step_tokens) == len(step_scores) == len(frontiers) + 1
    cand_tokens, cand_parents, cand_scores = [], [], []
    offset_prev = 0  # flat index of step s-1's first candidate
    offset = 0
    for s, (tokens, scores) in enumerate(zip(step_tokens, step_scores)):
        batch, num_frontier, topk = tokens.shape
        if s == 0:
            parent = torch.full((batch, num_frontier), -1, dtype=torch.int64, device=tokens.device)
        else:
            parent = frontiers[s - 1].to(torch.int64) + offset_prev
        cand_tokens.append(tokens.reshape(batch, -1))
        cand_scores.append(scores.reshape(batch, -1))
        cand_parents.append(parent[:, :, None].expand(batch, num_frontier, topk).reshape(batch, -1))
        offset_prev, offset = offset, offset + num_frontier * topk
    return (
        torch.cat(cand_tokens, 1).to(torch.int64),
        torch.cat(cand_parents, 1),
        torch.cat(cand_scores, 1),
    )


def select_draft_nodes(
    root_tokens: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_scores: torch.Tensor,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2 rerank: keep the ``num_draft_tokens - 1`` best candidates and put the root on top.

    root_tokens: [B] the last verified token of each request (becomes node 0).
    cand_tokens: [B, M] candidate token ids.
    cand_parents: [B, M] int, the parent candidate of each candidate (an index < its own), or -1
      when its parent is the root. ``flatten_expansion_steps`` builds this layout from per-step
      drafter outputs.
    cand_scores: [B, M] float, cumulative path scores: cumulative log-probabilities (recommended,
      they do not underflow on deep trees) or the products of probabilities. Only their order is
      used, so either works. -inf ranks last (padding), but still fills the tree when fewer than
      N - 1 candidates are finite.

    Returns (tokens [B, N], parents [B, N]) int64 in the module's conventions. The kept nodes are
    re-indexed in rank order (node 1 is the best candidate), which puts parents before children and
    siblings best first.

    A kept node needs all its ancestors kept. Products of probabilities never grow along a path,
    so a child never outscores its parent; to guarantee closure whatever the input, a candidate is
    ranked by the minimum score along its path (the same value when scores are monotone), and ties
    go to the smaller candidate index, which is the ancestor when a child ties with its parent.
    """
    batch, num_cand = cand_tokens.shape
    num_keep = num_draft_tokens - 1
    if num_keep > num_cand:
        raise ValueError(f"{num_draft_tokens} draft tokens need {num_keep} candidates, got {num_cand}")
    device = cand_tokens.device
    cand_parents = cand_parents.to(torch.int64)
    _check(cand_parents < torch.arange(num_cand, device=device), "cand_parents[b, m] must be < m")
    _check(cand_parents >= -1, "cand_parents must be >= -1")

    # Minimum score along each path by pointer jumping: after round k, ``path_min`` covers the
    # candidate and its 2^k - 1 nearest ancestors and ``jump`` points past them, so log2(M) rounds
    # cover any path with a fixed number of launches and no host sync.
    path_min = cand_scores.clone()
    jump = cand_parents.clone()
    for _ in range(max(1, math.ceil(math.log2(num_cand + 1)))):
        has = jump >= 0
        at = jump.clamp(min=0)
        path_min = torch.where(has, torch.minimum(path_min, path_min.gather(1, at)), path_min)
        jump = torch.where(has, jump.gather(1, at), jump)

    # Stable sort: equal scores keep candidate-index order, so an ancestor precedes its tied child.
    chosen = torch.sort(path_min, dim=1, descending=True, stable=True).indices[:, :num_keep]  # [B, N-1]

    new_index = torch.full((batch, num_cand), -1, dtype=torch.int64, device=device)
    ranks = torch.arange(1, num_keep + 1, device=device).expand(batch, num_keep)
    new_index.scatter_(1, chosen, ranks)
    old_parent = cand_parents.gather(1, chosen)
    new_parent = torch.where(old_parent < 0, torch.zeros_like(old_parent), new_index.gather(1, old_parent.clamp(min=0)))

    chosen_tokens = cand_tokens.to(torch.int64).gather(1, chosen)
    tokens = torch.cat([root_tokens.to(torch.int64).reshape(batch, 1), chosen_tokens], 1)
    parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.int64, device=device), new_parent], 1)
    return tokens, parents


# --- tree tensors ---------------------------------------------------------------------------


def _check_parents(parents: torch.Tensor) -> None:
    num_nodes = parents.shape[1]
    _check(parents[:, 0] == -1, "node 0 must be the root (parent -1)")
    if num_nodes > 1:
        rest = parents[:, 1:]
        _check((rest >= 0) & (rest < torch.arange(1, num_nodes, device=parents.device)),
               "every non-root node needs a parent with a smaller index")


def traversal_arrays(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First child and next sibling of every node (``TreeInfo.retrive_next_token`` and
    ``retrive_next_sibling``: node-local, -1 = none) of trees given by their parents, [B, N] int64
    in the module's conventions (unchecked here)."""
    num_nodes = parents.shape[1]
    nodes = torch.arange(num_nodes, device=parents.device)
    # Children of node i are the j with parents[j] == i; the first in index order is the best.
    is_child = parents[:, None, :] == nodes[None, :, None]  # [B, i, j]: j is a child of i
    none = torch.full_like(is_child, num_nodes, dtype=torch.int64)
    first_child = torch.where(is_child, nodes, none).amin(-1)
    # The next sibling of i is the first j > i with the same parent (the root has none).
    same_parent = parents[:, None, :] == parents[:, :, None]
    is_next_sibling = same_parent & (nodes[None, :] > nodes[:, None]) & (nodes > 0)[:, None]
    next_sibling = torch.where(is_next_sibling, nodes, none).amin(-1)
    minus_one = torch.full_like(first_child, -1)
    return (torch.where(first_child < num_nodes, first_child, minus_one),
            torch.where(next_sibling < num_nodes, next_sibling, minus_one))


def build_tree_reference(parents: torch.Tensor, seq_lens: torch.Tensor, max_depth: int | None = None) -> TreeInfo:
    """parents: [B, N] int (-1 for the root, else a smaller index); seq_lens: [B] tokens whose KV is
    already cached (the root's position). max_depth: a static bound on the depths, or None to take
    the actual maximum."""
    parents = parents.to(torch.int64)
    batch, num_nodes = parents.shape
    device = parents.device
    _check_parents(parents)
    rows = torch.arange(batch, device=device)
    nodes = torch.arange(num_nodes, device=device)

    # Parents come first, so a node's ancestor set is its parent's plus itself: one pass in index order.
    mask = torch.eye(num_nodes, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    depths = torch.zeros(batch, num_nodes, dtype=torch.int64, device=device)
    for i in range(1, num_nodes):
        parent = parents[:, i]
        mask[:, i] |= mask[rows, parent]
        depths[:, i] = depths[rows, parent] + 1

    next_token, next_sibling = traversal_arrays(parents)
    if max_depth is None:
        max_depth = int(depths.max()) if depths.numel() else 0
    else:
        _check(depths <= max_depth, f"a node is deeper than max_depth={max_depth}")
    return TreeInfo(
        parents=parents,
        mask=mask,
        depths=depths,
        positions=seq_lens.to(torch.int64).reshape(batch, 1) + depths,
        retrive_index=rows[:, None] * num_nodes + nodes[None, :],
        retrive_next_token=next_token,
        retrive_next_sibling=next_sibling,
        max_depth=max_depth,
    )


def build_tree(parents: torch.Tensor, seq_lens: torch.Tensor, max_depth: int | None = None) -> TreeInfo:
    """Dispatch: the Triton kernel on CUDA, the torch reference elsewhere. On CUDA pass max_depth
    (the drafter's num_steps) to avoid reading the depths back to the host."""
    if parents.is_cuda:
        from specjet.kernels.triton_tree import build_tree_triton

        return build_tree_triton(parents, seq_lens, max_depth)
    return build_tree_reference(parents, seq_lens, max_depth)
