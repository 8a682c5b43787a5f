"""Verification of a draft tree against one target forward.

Tree conventions are those of ``tree.py`` (node 0 = root = last verified token, parents before
children, siblings best first). The target forward ran over all N nodes of every request with
the tree mask, so row i of its output is the target's prediction for the token AFTER node i.

Every verifier returns the same three tensors:
  accepted_nodes [B, max_depth + 1] int64: the accepted path, node-local indices, root first,
    padded with -1;
  accept_lens [B] int64: nodes on the path (>= 1, the root always counts);
  bonus_ids [B] int64: the target's token after the last path node.
The tokens a request commits are ``tokens[b, path[1:]]`` followed by ``bonus_ids[b]``.
"""
from __future__ import annotations

import torch

from specjet.kernels import cpu_ops
from specjet.kernels.sampling import SamplingTensors, cpu_sampler_serves, sample_from_probs
from specjet.kernels.tree_info import TreeInfo


def _first_child_where(parents: torch.Tensor, cur: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """Per request, the smallest node j with parents[b, j] == cur[b] and flags[b, j], or N if none.
    Index order among siblings is draft order, so this is the first qualifying child tried."""
    num_nodes = parents.shape[1]
    nodes = torch.arange(num_nodes, device=parents.device)
    hit = (parents == cur[:, None]) & flags
    return torch.where(hit, nodes, torch.full_like(parents, num_nodes)).amin(-1)


def _walk(tree: TreeInfo, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow, from the root, the first child whose ``accepted`` flag is set; stop at the first node
    with none. Returns (accepted_nodes, accept_lens, last node)."""
    batch, num_nodes = tree.parents.shape
    device = tree.parents.device
    path = torch.full((batch, tree.max_depth + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = 0
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    for depth in range(1, tree.max_depth + 1):
        nxt = _first_child_where(tree.parents, cur, accepted)
        active = active & (nxt < num_nodes)
        cur = torch.where(active, nxt, cur)
        path[:, depth] = torch.where(active, nxt, path[:, depth])
    return path, (path >= 0).sum(-1), cur


def verify_tree_greedy_reference(
    tokens: torch.Tensor, tree: TreeInfo, target_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens: [B, N] draft token of each node; target_ids: [B, N] the target's argmax after each
    node (the verify output at flat row ``tree.retrive_index[b, i]``). Walk from the root, at each
    node moving to the first child whose token is the target's argmax there; the first node without
    such a child ends the path, and the argmax there is the bonus token."""
    target_ids = target_ids.to(torch.int64)
    parent_target = target_ids.gather(1, tree.parents.clamp(min=0))  # target after each node's parent
    matches = tokens.to(torch.int64) == parent_target
    matches[:, 0] = False  # the root is nobody's child
    path, lens, last = _walk(tree, matches)
    return path, lens, target_ids.gather(1, last[:, None]).squeeze(1)


def verify_tree_sampling_reference(
    tokens: torch.Tensor, tree: TreeInfo, target_probs: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree verification of a sampled request for deterministic drafts (a node's draft is its token),
    as plain decoding would have decoded.

    tokens: [B, N] draft tokens. target_probs: [B, N, V] the target's distribution after each node, already
    filtered by the caller (temperature, top-k, top-p, min-p). uniforms: [B, N] float32 in [0, 1), indexed by
    depth: ``uniforms[b, d]`` is the coin of the sequence position the token after a node of depth d takes
    (kernels/coins.py). Each node's token is the inverse-CDF draw of its row at its depth's coin (the rule of
    ``sampling.sample_from_probs``, plain decoding's draw on these devices), and the walk follows, from the root,
    the first child holding it; the first node without one ends the path and its token is the bonus.

    Every committed token is then plain decoding's draw after the same tokens with the same coin: the output is
    plain decoding's, so it follows the target distribution exactly, and a node is accepted with the target's
    probability of its token (for a single child, what rejection sampling against a point-mass draft gives).
    """
    batch, num_nodes, vocab = target_probs.shape
    if uniforms.shape[1] < num_nodes:  # a node's depth is below the node count
        raise ValueError(f"uniforms hold {uniforms.shape[1]} depths' coins for trees of {num_nodes} nodes")
    coin = uniforms.gather(1, tree.depths)
    drawn = sample_from_probs(target_probs.reshape(batch * num_nodes, vocab).float(), coin.reshape(-1))
    return verify_tree_greedy_reference(tokens, tree, drawn.view(batch, num_nodes))


# --- dispatch: Triton on CUDA (greedy), the torch reference elsewhere --------------------------------


def verify_tree_greedy(tokens: torch.Tensor, tree: TreeInfo, target_ids: torch.Tensor):
    if tokens.is_cuda:
        from specjet.kernels.triton_tree import verify_tree_greedy_triton

        return verify_tree_greedy_triton(tokens, tree, target_ids)
    return verify_tree_greedy_reference(tokens, tree, target_ids)


def verify_tree_sampling(tokens: torch.Tensor, tree: TreeInfo, target_probs: torch.Tensor, uniforms: torch.Tensor):
    """The torch reference on every device: its draws are ``sample_from_probs``', plain decoding's there."""
    return verify_tree_sampling_reference(tokens, tree, target_probs, uniforms)


def verify_trees_sampling_cpu(logits: torch.Tensor, offsets: list[int], tokens: list[list[int]],
                              parents: list[list[int]], uniforms: list[torch.Tensor], st: SamplingTensors,
                              grammar: tuple[torch.Tensor, torch.Tensor] | None = None
                              ) -> list[tuple[list[int], int]] | None:
    """``verify_tree_sampling`` of sampled requests (temperature > 0) straight from their logits, one C++ walk a
    request (csrc/sampling.cpp ``verify_tree_sample``): a node's token is drawn only when the path reaches it, by
    the very function plain decoding's CPU draw uses (``sample_lists``: the same filters, weights and coin), so the
    committed tokens are plain decoding's bit for bit. Request b's node rows are
    ``logits[offsets[b]:offsets[b] + len(tokens[b])]``; ``st`` holds one row of parameters per request;
    ``grammar`` (bitmask [R, W] int32, masked [R] bool, a row per logits row) reads the flagged rows through their
    token bitmask as plain decoding reads a constrained row. Returns (path, bonus) per request, or None where the
    C++ ops do not serve these logits (not built, not a CPU float32 tensor)."""
    if not cpu_sampler_serves(logits):
        return None
    sizes = [len(t) for t in tokens]
    path, lens, bonus = cpu_ops.extension().verify_tree_sample(
        logits, torch.tensor(offsets, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64),
        torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64),
        torch.tensor([p for ps in parents for p in ps], dtype=torch.int64),
        torch.cat(uniforms).to(torch.float32), st.temperatures, st.top_ks, st.top_ps, st.min_ps,
        None if grammar is None else grammar[0], [] if grammar is None else grammar[1].tolist())
    return [(nodes[:n], b) for nodes, n, b in zip(path.tolist(), lens.tolist(), bonus.tolist())]

