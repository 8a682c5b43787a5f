"""Triton kernels for draft trees, used on CUDA: tree tensors and greedy verification (a sampled request's
verify draws with the torch reference, plain decoding's own draw there: kernels/tree_verify.py).

Same contracts as the torch references in ``tree.py`` and ``tree_verify.py``. Each kernel runs one
program per request: a tree has at most a few dozen nodes, so a whole request fits in one block
of ``BLOCK_N`` lanes (nodes), and [BLOCK_N, BLOCK_N] tiles stand in for the references'
[B, N, N] comparisons. What the references do with a batched loop over depth (walking the tree)
each program does with a scalar loop over depth, and it writes every output element exactly once,
so no output needs to be pre-filled and no two lanes race.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specjet.kernels.tree_info import TreeInfo


def _block_nodes(num_nodes: int) -> int:
    return max(16, triton.next_power_of_2(num_nodes))


# --- build_tree ------------------------------------------------------------------------------


@triton.jit
def _build_tree_kernel(
    parents_ptr, seq_lens_ptr,
    mask_ptr, depths_ptr, positions_ptr, retrive_index_ptr, next_token_ptr, next_sibling_ptr,
    num_nodes,
    BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < num_nodes
    row = parents_ptr + req * num_nodes
    parent = tl.load(row + offs, mask=valid, other=-2).to(tl.int32)  # -2 on padding: nobody's parent

    # seen[i, j]: j is i or an ancestor of i. Chase each node's ancestor chain one step per round;
    # a chain is at most num_nodes long.
    anc = tl.where(valid, offs, -1)
    seen = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.int32)
    for _ in range(num_nodes):
        seen = seen | ((anc[:, None] == offs[None, :]) & (anc[:, None] >= 0)).to(tl.int32)
        anc = tl.load(row + anc, mask=anc >= 0, other=-1).to(tl.int32)
    depth = tl.sum(seen, axis=1) - 1

    # Children of i: the j with parent[j] == i, the first in index order being the best draft.
    is_child = (parent[None, :] == offs[:, None]) & valid[None, :]  # [i, j]
    first_child = tl.min(tl.where(is_child, offs[None, :], BLOCK_N), axis=1)
    # Next sibling of i: the first j > i with i's parent; the root has no siblings.
    same_parent = (parent[None, :] == parent[:, None]) & valid[None, :]
    is_next = same_parent & (offs[None, :] > offs[:, None]) & (offs[:, None] > 0)
    next_sibling = tl.min(tl.where(is_next, offs[None, :], BLOCK_N), axis=1)

    seq_len = tl.load(seq_lens_ptr + req)
    out = req * num_nodes + offs
    tl.store(depths_ptr + out, depth, mask=valid)
    tl.store(positions_ptr + out, seq_len + depth, mask=valid)
    tl.store(retrive_index_ptr + out, out, mask=valid)
    tl.store(next_token_ptr + out, tl.where(first_child < BLOCK_N, first_child, -1), mask=valid)
    tl.store(next_sibling_ptr + out, tl.where(next_sibling < BLOCK_N, next_sibling, -1), mask=valid)
    mask_ptrs = mask_ptr + req * num_nodes * num_nodes + offs[:, None] * num_nodes + offs[None, :]
    tl.store(mask_ptrs, seen.to(mask_ptr.dtype.element_ty), mask=valid[:, None] & valid[None, :])


def build_tree_triton(parents: torch.Tensor, seq_lens: torch.Tensor, max_depth: int | None = None) -> TreeInfo:
    # No input checks here (they would stall the stream); the reference checks the same contract.
    parents = parents.to(torch.int64).contiguous()
    batch, num_nodes = parents.shape
    device = parents.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64).contiguous()
    mask = torch.empty((batch, num_nodes, num_nodes), dtype=torch.bool, device=device)
    depths, positions, retrive_index, next_token, next_sibling = (
        torch.empty((batch, num_nodes), dtype=torch.int64, device=device) for _ in range(5)
    )
    if batch and num_nodes:
        _build_tree_kernel[(batch,)](
            parents, seq_lens,
            mask.view(torch.uint8), depths, positions, retrive_index, next_token, next_sibling,
            num_nodes,
            BLOCK_N=_block_nodes(num_nodes),
            num_warps=4,
        )
    if max_depth is None:
        max_depth = int(depths.max()) if depths.numel() else 0
    return TreeInfo(
        parents=parents, mask=mask, depths=depths, positions=positions, retrive_index=retrive_index,
        retrive_next_token=next_token, retrive_next_sibling=next_sibling, max_depth=max_depth,
    )


# --- greedy verification ---------------------------------------------------------------------


@triton.jit
def _verify_greedy_kernel(
    tokens_ptr, parents_ptr, target_ptr,
    path_ptr, lens_ptr, bonus_ptr,
    num_nodes, max_depth,
    BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    valid = offs < num_nodes
    parent = tl.load(parents_ptr + req * num_nodes + offs, mask=valid, other=-2).to(tl.int32)
    token = tl.load(tokens_ptr + req * num_nodes + offs, mask=valid, other=-1)
    target_row = target_ptr + req * num_nodes
    path_row = path_ptr + req * (max_depth + 1)

    tl.store(path_row, 0)
    cur = tl.program_id(0) * 0  # int32 scalar: the root
    active = cur == 0
    length = cur + 1
    for depth in range(1, max_depth + 1):
        want = tl.load(target_row + cur)
        hit = (parent == cur) & (token == want) & valid
        nxt = tl.min(tl.where(hit, offs, BLOCK_N), axis=0)
        active = active & (nxt < BLOCK_N)
        tl.store(path_row + depth, tl.where(active, nxt, -1))
        cur = tl.where(active, nxt, cur)
        length += active.to(tl.int32)
    tl.store(lens_ptr + req, length)
    tl.store(bonus_ptr + req, tl.load(target_row + cur))


def verify_tree_greedy_triton(tokens: torch.Tensor, tree: TreeInfo, target_ids: torch.Tensor):
    batch, num_nodes = tokens.shape
    device = tokens.device
    path = torch.empty((batch, tree.max_depth + 1), dtype=torch.int64, device=device)
    lens = torch.empty(batch, dtype=torch.int64, device=device)
    bonus = torch.empty(batch, dtype=torch.int64, device=device)
    if batch:
        _verify_greedy_kernel[(batch,)](
            tokens.to(torch.int64).contiguous(), tree.parents.to(torch.int64).contiguous(),
            target_ids.to(torch.int64).contiguous(),
            path, lens, bonus,
            num_nodes, tree.max_depth,
            BLOCK_N=_block_nodes(num_nodes),
            num_warps=1,
        )
    return path, lens, bonus
