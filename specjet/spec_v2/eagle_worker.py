"""EAGLE-2 drafting with a trained head: dynamic draft trees from the head's own hidden states.

Per request the drafter keeps a *draft state*: the head's hidden output at the request's last
committed position (it stands in for the target's next feature) and the top-k next tokens it
predicts there. One iteration:

1. draft: the root (last verified token) gets the state's top-k as children (scores: log-probs);
   each of ``num_steps - 1`` draft forwards feeds the current frontier (the ``topk`` best nodes by
   path score) with their parents' hidden states and expands each into its top-k children;
2. rerank: the ``num_draft_tokens - 1`` best nodes by path score form the tree (kernels/tree.py);
3. (the target verifies the tree: spec_v2/tree_verifier.py);
4. extend: the head runs over the accepted tokens with the target's hidden states at the real
   positions, writing its KV there and producing the next draft state.

The tree nodes' draft KV lives in scratch slots taken from the allocator after a snapshot and given
back by restoring it. Each frontier node attends to the request's committed draft KV, its
ancestors' scratch KV and itself: it is run as its own single-token row whose slot list is the
request's prefix followed by its ancestor chain, so no tree mask is needed in the draft forwards.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specjet.kernels.tree import flatten_expansion_steps, select_draft_nodes
from specjet.models.eagle import EagleDraftModel
from specjet.models.forward_batch import ForwardBatch, ForwardMode
from specjet.models.kv_cache import KVCache
from specjet.models.runner import ModelRunner


@dataclass(frozen=True)
class EagleParams:
    num_steps: int = 4
    topk: int = 4
    num_draft_tokens: int = 12


@dataclass
class DraftState:
    hidden: torch.Tensor  # [h] head output at the last committed position
    top_ids: torch.Tensor  # [topk] target ids of the predicted next tokens, best first
    top_logp: torch.Tensor  # [topk] their log-probabilities


@dataclass
class DraftView:
    """What the drafter needs of one request."""

    rid: str
    row: int
    committed_len: int  # positions whose target (and draft) KV is valid


class EagleDrafter:
    def __init__(self, runner: ModelRunner, head: EagleDraftModel, params: EagleParams, allocator):
        if params.topk < 1 or params.num_steps < 1 or params.num_draft_tokens < 1:
            raise ValueError(f"invalid EAGLE parameters {params}")
        self.runner = runner
        self.head = head.bind_target(runner.model)
        self.params = params
        self.allocator = allocator
        cfg = runner.config
        self.kv_cache = KVCache(1, runner.kv_cache.num_slots, cfg.num_kv_heads, cfg.head_dim, runner.dtype,
                                runner.device)
        self.states: dict[str, DraftState] = {}

    def scratch_slots(self, batch_size: int) -> int:
        """Slots the drafting of one batch borrows (and returns) from the allocator."""
        per_step = self.allocator.slots_needed(0, batch_size * self.params.topk)
        return per_step * (self.params.num_steps - 1)

    # ---------------------------------------------------------------- prefill / extend
    def extend(self, views: list[DraftView], token_lists: list[list[int]], features: torch.Tensor,
               req_to_token: torch.Tensor) -> None:
        """Run the head over new positions of each request and keep its new draft state.

        For request b, ``token_lists[b][j]`` is the token AFTER position committed_len_b + j and
        ``features`` holds, in the same flat order, the target's hidden state at that position.
        Prefill: positions 0..n-1 with the prompt shifted by one plus the first sampled token.
        After verify: the accepted path's positions with its tokens and the bonus."""
        device = req_to_token.device
        q_lens = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device=device)
        starts = torch.tensor([v.committed_len for v in views], dtype=torch.int64, device=device)
        positions = torch.cat([torch.arange(v.committed_len, v.committed_len + len(t), device=device)
                               for v, t in zip(views, token_lists)])
        rows = torch.tensor([v.row for v in views], dtype=torch.int64, device=device)
        slots = torch.cat([req_to_token[v.row, v.committed_len:v.committed_len + len(t)]
                           for v, t in zip(views, token_lists)])
        batch = ForwardBatch.build(
            ForwardMode.EXTEND,
            input_ids=torch.tensor([x for t in token_lists for x in t], dtype=torch.int64, device=device),
            positions=positions,
            out_cache_loc=slots,
            req_to_token=req_to_token,
            req_pool_indices=rows,
            kv_lens=starts + q_lens,
            q_lens=q_lens,
            logits="last",
        )
        hidden, logits = self.head(batch, features.to(self.runner.dtype), self.kv_cache)
        last_hidden = hidden[batch.logits_indices]
        top_logp, top_idx = torch.log_softmax(logits, -1).topk(self.params.topk, dim=-1)
        top_ids = self.head.hot_to_full(top_idx)
        for b, view in enumerate(views):
            self.states[view.rid] = DraftState(last_hidden[b], top_ids[b], top_logp[b])

    # ---------------------------------------------------------------- drafting
    def propose(self, views: list[DraftView], root_tokens: list[int], req_to_token: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """EAGLE-2 trees for a batch: (tokens [B, N], parents [B, N]), root at node 0, nodes in rank
        order (any prefix of the node list is itself a tree)."""
        p = self.params
        device = req_to_token.device
        batch, k = len(views), p.topk
        states = [self.states[v.rid] for v in views]
        committed = torch.tensor([v.committed_len for v in views], dtype=torch.int64, device=device)
        step_tokens = [torch.stack([s.top_ids for s in states])[:, None, :]]  # [B, 1, k]
        step_scores = [torch.stack([s.top_logp for s in states]).float()[:, None, :]]
        frontiers: list[torch.Tensor] = []
        cur_tokens = step_tokens[0].reshape(batch, k)
        cur_scores = step_scores[0].reshape(batch, k)
        cur_feat = torch.stack([s.hidden for s in states])[:, None, :].expand(batch, k, -1)
        chains = torch.zeros((batch, k, 0), dtype=torch.int64, device=device)  # ancestors' scratch slots
        width = int(committed.max()) + p.num_steps
        rows = torch.tensor([v.row for v in views], device=device)
        prefix = torch.zeros((batch, width), dtype=torch.int64, device=device)  # [B, W]; may outgrow the table
        copied = min(width, req_to_token.shape[1])
        prefix[:, :copied] = req_to_token[rows, :copied]
        snapshot = self.allocator.snapshot()
        try:
            for step in range(1, p.num_steps):
                frontiers.append(torch.arange(k, device=device).expand(batch, k) if step == 1 else next_frontier)
                own = self.allocator.extend(torch.empty(0, dtype=torch.int64), 0, batch * k)[: batch * k]
                own = own.to(device).view(batch, k, 1)
                chains = torch.cat([chains, own], dim=-1)  # [B, k, step]: depth-1 .. depth-step nodes
                depth = step
                # One row per frontier node: the request's committed prefix, then its chain.
                table = prefix[:, None, :].expand(batch, k, width).clone()
                cols = committed[:, None, None] + torch.arange(depth, device=device)[None, None, :]
                table.scatter_(2, cols, chains)
                table = table.view(batch * k, width)
                positions = (committed + depth - 1).repeat_interleave(k)
                fb = ForwardBatch.build(
                    ForwardMode.DECODE,
                    input_ids=cur_tokens.reshape(-1),
                    positions=positions,
                    out_cache_loc=own.reshape(-1),
                    req_to_token=table,
                    req_pool_indices=torch.arange(batch * k, device=device),
                    kv_lens=positions + 1,
                    q_lens=torch.ones(batch * k, dtype=torch.int64, device=device),
                    logits="all",
                )
                hidden, logits = self.head(fb, cur_feat.reshape(batch * k, -1), self.kv_cache)
                logp, idx = torch.log_softmax(logits, -1).topk(k, dim=-1)  # [B*k, k]
                child_ids = self.head.hot_to_full(idx).view(batch, k, k)
                child_scores = cur_scores[:, :, None] + logp.view(batch, k, k)
                step_tokens.append(child_ids)
                step_scores.append(child_scores)
                if step + 1 < p.num_steps:  # pick the next frontier: the k best children overall
                    next_frontier = child_scores.view(batch, k * k).topk(k, dim=-1).indices  # f * k + c
                    parent = next_frontier // k
                    cur_tokens = child_ids.view(batch, k * k).gather(1, next_frontier)
                    cur_scores = child_scores.view(batch, k * k).gather(1, next_frontier)
                    cur_feat = hidden.view(batch, k, -1).gather(1, parent[:, :, None].expand(-1, -1, hidden.shape[-1]))
                    chains = chains.gather(1, parent[:, :, None].expand(-1, -1, chains.shape[-1]))
        finally:
            self.allocator.restore(snapshot)
        cand_tokens, cand_parents, cand_scores = flatten_expansion_steps(step_tokens, step_scores, frontiers)
        roots = torch.tensor(root_tokens, dtype=torch.int64, device=device)
        num_nodes = min(p.num_draft_tokens, cand_tokens.shape[1] + 1)
        return select_draft_nodes(roots, cand_tokens, cand_parents, cand_scores, num_nodes)

    def release(self, rid: str) -> None:
        self.states.pop(rid, None)
