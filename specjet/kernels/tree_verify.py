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
from specjet.kernels.sampling import SamplingTensors, cpu_sampler_serves
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


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative weight exceeds u * total (the rule of
    ``sampling.sample_from_probs``). weights [B, V] >= 0, uniforms [B] in [0, 1).
    If u * total rounds up to the total, the first token where the cumulative weight reaches it
    (a token with weight); rows with no weight at all get ``fallback``."""
    cdf = weights.cumsum(-1)
    total = cdf[:, -1:].contiguous()
    ids = torch.searchsorted(cdf, uniforms.to(cdf.dtype)[:, None] * total, right=True).squeeze(-1)
    reach = torch.searchsorted(cdf, total, right=False).squeeze(-1)
    ids = torch.where(ids < weights.shape[-1], ids, reach)
    return torch.where(total.squeeze(-1) > 0, ids, fallback)


def _zero_children_(probs: torch.Tensor, tokens: torch.Tensor, is_child: torch.Tensor) -> torch.Tensor:
    """Set probs[b, tokens[b, j]] = 0 for the flagged children j, in place, touching only those N
    entries per row (a min with 0, so a token shared with an unflagged node stays zeroed). The
    result is the residual once every child has been tried and rejected."""
    zero_or_keep = torch.where(is_child, 0.0, float("inf")).to(probs.dtype)
    return probs.scatter_reduce_(1, tokens, zero_or_keep, reduce="amin")


def verify_tree_sampling_reference(
    tokens: torch.Tensor, tree: TreeInfo, target_probs: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree rejection sampling for deterministic drafts (each node's draft distribution is
    a point mass on its token, as with top-k drafting).

    tokens: [B, N] draft tokens. target_probs: [B, N, V] the target's distribution after each node,
    already filtered by the caller (temperature, top-k, top-p, min-p; a one-hot for greedy rows,
    which makes this agree with ``verify_tree_greedy``). uniforms: [B, N] float32 in [0, 1) (as
    ``torch.rand`` gives), drawn by the caller from each request's own generator, so a seeded
    request verifies the same whatever batch it shares: ``uniforms[b, j]`` (j >= 1) is the coin
    that decides node j when it is tried (each node is tried at most once), and ``uniforms[b, 0]``
    (the root is never tried) draws the bonus token.

    At the current node with residual r (initially its target_probs row), the children are tried
    in draft order: child x is accepted with probability r(x) / sum(r); on rejection r(x) := 0 and
    the next sibling is tried. An accepted child becomes the current node, with a fresh residual
    (its own target_probs row). When every child is rejected (or there are none), the bonus is drawn
    from the final residual. Each committed token then follows the target distribution exactly:
    the children are accepted with probabilities r(x_1), r(x_2), ... of the original r, and the
    bonus takes the remaining mass, r restricted to the other tokens.

    The renormalised sequence is computed without re-summing after each rejection: when x_j is
    tried, the remaining mass is the mass no child claims plus the children from x_j on. The last
    child with all the remaining mass therefore gets a ratio of exactly 1 and cannot be rejected by
    rounding.
    """
    batch, num_nodes = tokens.shape
    device = tokens.device
    tokens = tokens.to(torch.int64)
    nodes = torch.arange(num_nodes, device=device)
    rows = torch.arange(batch, device=device)
    parents = tree.parents
    # A sibling repeating an earlier sibling's token finds r(x) already zero: it is never accepted.
    same_family = (parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])
    repeats = (same_family & (nodes[None, :] < nodes[:, None])).any(-1)  # [B, j]: an earlier sibling has j's token

    path = torch.full((batch, tree.max_depth + 1), -1, dtype=torch.int64, device=device)
    path[:, 0] = 0
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)
    for depth in range(1, tree.max_depth + 1):
        # Advanced indexing copies, so the row may be zeroed in place; only [B, V]-sized work per
        # level (one copy, one sum): the reference also serves CPU batches with a real vocabulary.
        probs = target_probs[rows, cur].float()  # [B, V]
        is_child = (parents == cur[:, None]) & (nodes > 0)
        tried = is_child & ~repeats
        child_mass = torch.where(tried, probs.gather(1, tokens), 0.0)  # [B, N]
        unclaimed = _zero_children_(probs, tokens, is_child).sum(-1)  # [B]
        from_here = child_mass.flip(-1).cumsum(-1).flip(-1)  # mass of the children from j on
        remaining = unclaimed[:, None] + from_here
        positive = remaining > 0
        ratio = torch.where(positive, child_mass / torch.where(positive, remaining, 1.0), 0.0)
        accepted = tried & (uniforms.to(ratio.dtype) < ratio)
        nxt = torch.where(accepted, nodes, torch.full_like(accepted, num_nodes, dtype=torch.int64)).amin(-1)
        active = active & (nxt < num_nodes)
        cur = torch.where(active, nxt, cur)
        path[:, depth] = torch.where(active, nxt, path[:, depth])

    probs = target_probs[rows, cur].float()
    argmax = probs.argmax(-1)  # only for a residual with no mass, i.e. an all-zero row
    residual = _zero_children_(probs, tokens, (parents == cur[:, None]) & (nodes > 0))
    bonus = _inverse_cdf(residual, uniforms[:, 0], fallback=argmax)
    return path, (path >= 0).sum(-1), bonus


# --- dispatch: Triton on CUDA, the torch reference elsewhere --------------------------------


def verify_tree_greedy(tokens: torch.Tensor, tree: TreeInfo, target_ids: torch.Tensor):
    if tokens.is_cuda:
        from specjet.kernels.triton_tree import verify_tree_greedy_triton

        return verify_tree_greedy_triton(tokens, tree, target_ids)
    return verify_tree_greedy_reference(tokens, tree, target_ids)


def verify_tree_sampling(tokens: torch.Tensor, tree: TreeInfo, target_probs: torch.Tensor, uniforms: torch.Tensor):
    if tokens.is_cuda:
        from specjet.kernels.triton_tree import verify_tree_sampling_triton

        return verify_tree_sampling_triton(tokens, tree, target_probs, uniforms)
    return verify_tree_sampling_reference(tokens, tree, target_probs, uniforms)


def verify_trees_sampling_cpu(logits: torch.Tensor, offsets: list[int], tokens: list[list[int]],
                              parents: list[list[int]], uniforms: list[torch.Tensor],
                              st: SamplingTensors) -> list[tuple[list[int], int]] | None:
    """``verify_tree_sampling`` of sampled requests (temperature > 0) straight from their logits, one C++ walk a
    request (csrc/sampling.cpp ``verify_tree_sample``): a node's row is filtered (temperature, top-k, top-p,
    min-p: ``sample``'s rule) only when the path reaches it, where the reference builds every node's whole
    filtered distribution first. Request b's node rows are ``logits[offsets[b]:offsets[b] + len(tokens[b])]``;
    ``st`` holds one row of parameters per request. The same acceptance rule and residual draw as the reference,
    with each node's weights from the C++ exp (so a coin at the edge of two outcomes may fall the other way;
    tested against the reference's outcomes). Returns (path, bonus) per request, or None where the C++ ops do not
    serve these logits (not built, not a CPU float32 tensor)."""
    if not cpu_sampler_serves(logits):
        return None
    sizes = [len(t) for t in tokens]
    path, lens, bonus = cpu_ops.extension().verify_tree_sample(
        logits, torch.tensor(offsets, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64),
        torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64),
        torch.tensor([p for ps in parents for p in ps], dtype=torch.int64),
        torch.cat(uniforms).to(torch.float32), st.temperatures, st.top_ks, st.top_ps, st.min_ps)
    return [(nodes[:n], b) for nodes, n, b in zip(path.tolist(), lens.tolist(), bonus.tolist())]

