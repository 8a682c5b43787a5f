"""The tensors that describe a batch of draft trees (conventions in ``tree.py``), in a module of
their own because both builders of them, ``tree.py``'s torch reference and ``triton_tree.py``'s
kernel, and the verifiers that read them (``tree_verify.py``) need the type.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeInfo:
    parents: torch.Tensor  # [B, N] int64, parent node of each node; -1 for the root (node 0)
    mask: torch.Tensor  # [B, N, N] bool, mask[b, i, j]: node i attends to node j (j is i or an ancestor)
    depths: torch.Tensor  # [B, N] int64, 0 for the root
    positions: torch.Tensor  # [B, N] int64, seq_lens[b] + depths[b, i]: the root sits right after the cached prefix
    retrive_index: torch.Tensor  # [B, N] int64, b * N + i: the node's row in the flat verify batch
    retrive_next_token: torch.Tensor  # [B, N] int64, first child of the node (node-local), -1 if a leaf
    retrive_next_sibling: torch.Tensor  # [B, N] int64, next sibling in draft order (node-local), -1 if last
    max_depth: int  # bound on depths (a static one, e.g. num_steps, so CUDA callers need no sync)

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]
