"""EAGLE-2 drafting with a trained head: dynamic draft trees from the head's own hidden states.

Per request the drafter keeps a *draft state*: the head's hidden output at the request's last
committed position (it stands in for the target's next feature) and the top-k next tokens it
predicts there. One iteration:

1. draft: the root (last verified token) gets the state's top-k as children (scores: log-probs);
   each of ``num_steps - 1`` draft forwards feeds the current frontier (the ``topk`` best nodes by
   path score) with their parents' hidden states and expands each into its top-k children;
2. rerank: the ``tree_nodes - 1`` best nodes by path score form the tree (kernels/tree.py), less
   any whose path log-probability is below the request's cut (``DraftRequest.min_logp``: a verify row is
   not free);
3. (the target verifies the tree: spec_v2/tree_verifier.py);
4. extend: the head runs over the accepted tokens with the target's hidden states at the real
   positions, writing its KV there and producing the next draft state.

The tree nodes' draft KV lives in scratch slots taken from the allocator after a snapshot and given
back by restoring it. Each frontier node attends to the request's committed draft KV, its
ancestors' scratch KV and itself: it is run as its own single-token row whose slot list is the
request's prefix followed by its ancestor chain, so no tree mask is needed in the draft forwards.

Under a grammar (spec_v2/grammar_guide.py) every top-k is taken over the tokens the grammar allows
after the node, and the grammar's forced tokens enter as a chain under the root: the head runs
along the chain (no top-k there) and drafts its tree from the chain's end.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from specjet.grammar import bitmask_allows
from specjet.kernels.masked_topk import masked_topk_logp
from specjet.kernels.tree import flatten_expansion_steps, select_draft_nodes
from specjet.models.eagle import FOLLOW_TARGET, EagleDraftModel
from specjet.models.forward_batch import ForwardBatch, ForwardMode, host_token_tensors
from specjet.models.kv_cache import KVCache
from specjet.models.runner import ModelRunner
from specjet.spec_v2.config import EagleParams
from specjet.models.graph_runner import GraphRunner, capture_sizes
from specjet.spec_v2.drafter import DraftRequest, DraftTree, SpecInput
from specjet.spec_v2.grammar_guide import GrammarGuide
from specjet.spec_v2.tree_verifier import VerifyResult


# A forced-chain token is drafted as a sure node (no siblings) only where the head, under the grammar,
# puts at least this much mass on it; elsewhere the head's alternatives are worth their tree slots.
CHAIN_MIN_PROB = 0.9


@dataclass
class DraftState:
    hidden: torch.Tensor  # [h] head output at the last committed position
    top_ids: torch.Tensor  # [topk] target ids of the predicted next tokens, best first
    top_logp: torch.Tensor  # [topk] their log-probabilities
    logits: torch.Tensor  # [K] the head's logits there (K: its hot vocabulary), for grammar-masked top-k


@dataclass
class DraftView:
    """Where the head writes one request's draft KV."""

    rid: str
    row: int
    committed_len: int  # positions whose target (and draft) KV is valid


class EagleDrafter:
    """EAGLE-2 trees from a trained head (a ``Drafter``)."""

    def __init__(self, runner: ModelRunner, head: EagleDraftModel, params: EagleParams, allocator,
                 static: bool = False, cuda_graph: bool = False,
                 quantization: str | None = FOLLOW_TARGET):
        if params.topk > head.draft_vocab_size:
            raise ValueError(f"speculative_eagle_topk={params.topk} exceeds the EAGLE head's vocabulary of "
                             f"{head.draft_vocab_size} tokens")
        self.runner = runner
        self.head = head.bind_target(runner.model, quantization)
        self.feature_capture = self.head.feature_capture
        self.draft_kv_reads_next_token = True  # position t's draft KV comes from token t+1 and feature t
        self.params = params
        self.allocator = allocator
        cfg = runner.config
        self.kv_cache = KVCache(1, runner.kv_cache.num_slots, cfg.num_kv_heads, cfg.head_dim, runner.dtype,
                                runner.device)
        self.states: dict[str, DraftState] = {}
        self._vocab_ids: torch.Tensor | None = None
        # static: each draft step runs on padded static buffers per batch bucket (draft_runner.py);
        # a padded frontier row is token 0 at position 0 writing and reading the padding slot.
        self.graph = GraphRunner(
            self._step_forward, {"ids": 0, "positions": 0, "slots": 0, "table": 0, "features": 0.0},
            runner.device, capture=cuda_graph, growing=("table",)) if static else None

    def scratch_slots(self, batch_size: int) -> int:
        """Slots the drafting of one batch borrows (and returns) from the allocator."""
        per_step = self.allocator.slots_needed(0, batch_size * self.params.topk)
        return per_step * (self.params.num_steps - 1)

    # ---------------------------------------------------------------- the Drafter protocol
    def after_prefill(self, reqs: list[SpecInput], hidden: torch.Tensor | None, first_tokens: list[int],
                      req_to_token: torch.Tensor) -> None:
        """The draft prefill: the head reads (token t+1, target feature t) over the prefilled positions."""
        views = [DraftView(r.rid, r.row, r.committed_len) for r in reqs]
        self.extend(views, [r.token_ids[r.committed_len + 1:] + [tok] for r, tok in zip(reqs, first_tokens)], hidden,
                    req_to_token)

    def propose(self, reqs: list[DraftRequest], share: int, req_to_token: torch.Tensor) -> list[DraftTree]:
        guided = any(r.guide is not None for r in reqs)
        trees = self.draft_trees([_view(r.input) for r in reqs], [r.input.root for r in reqs], req_to_token,
                                 guides=[r.guide for r in reqs] if guided else None, chains=[r.chain for r in reqs],
                                 min_logps=[r.min_logp for r in reqs])
        return [(tokens[:r.budget], parents[:r.budget]) for (tokens, parents), r in zip(trees, reqs)]

    def after_verify(self, reqs: list[SpecInput], result: VerifyResult, req_to_token: torch.Tensor) -> None:
        """The head runs over the accepted path: at the path's j-th position it reads the token after
        it (the next path token, or the bonus) and the target's hidden state at that node."""
        hidden = result.output.hidden
        rows = torch.cat([torch.tensor(nodes) + off for nodes, off in zip(result.accepted_nodes, result.node_offsets)])
        self.extend([_view(r) for r in reqs], result.accepted_tokens, hidden[rows], req_to_token)

    # ---------------------------------------------------------------- prefill / extend
    def extend(self, views: list[DraftView], token_lists: list[list[int]], features: torch.Tensor,
               req_to_token: torch.Tensor) -> None:
        """Run the head over new positions of each request and keep its new draft state.

        For request b, ``token_lists[b][j]`` is the token AFTER position committed_len_b + j and
        ``features`` holds, in the same flat order, the target's hidden state at that position.
        Prefill: positions 0..n-1 with the prompt shifted by one plus the first sampled token.
        After verify: the accepted path's positions with its tokens and the bonus."""
        # The batch from host lists: ids, positions and slots as one tensor, the attention's layout from the
        # lengths (a verify's extend covers 2-3 positions a request: each small op's fixed cost is the cost).
        q_lens = [len(t) for t in token_lists]
        positions = [v.committed_len + j for v, n in zip(views, q_lens) for j in range(n)]
        slot_rows = [v.row for v, n in zip(views, q_lens) for _ in range(n)]
        ids, positions_t, slots = host_token_tensors(req_to_token, [x for t in token_lists for x in t], positions,
                                                     slot_rows, positions)
        batch = ForwardBatch.from_host(ForwardMode.EXTEND, ids, positions_t, slots, req_to_token,
                                       [v.row for v in views], q_lens,
                                       [v.committed_len + n for v, n in zip(views, q_lens)], last_logits=True)
        hidden, logits = self.head(batch, features.to(self.runner.dtype), self.kv_cache, from_target=True)
        last_hidden = hidden[batch.logits_indices]
        top_logp, top_idx = torch.log_softmax(logits, -1).topk(self.params.topk, dim=-1)
        top_ids = self.head.hot_to_full(top_idx)
        for b, view in enumerate(views):
            self.states[view.rid] = DraftState(last_hidden[b], top_ids[b], top_logp[b], logits[b])

    # ---------------------------------------------------------------- drafting
    def draft_trees(self, views: list[DraftView], root_tokens: list[int], req_to_token: torch.Tensor,
                guides: list[GrammarGuide | None] | None = None, chains: list[list[int]] | None = None,
                min_logps: list[float] | None = None) -> list[tuple[list[int], list[int]]]:
        """EAGLE-2 trees for a batch: per request (tokens, parents), root at node 0, nodes in rank
        order (any prefix of the node list is itself a tree), at most ``tree_nodes`` nodes.

        Grammar-aware drafting: ``guides[b]`` (or None) makes every top-k of request b, the root's
        included, range over the tokens its grammar allows after that node, so no tree slot goes
        to a token verification must reject; ``chains[b]`` (the grammar's forced tokens, or [])
        becomes nodes 1..c, a chain under the root ranked above every drafted node (probability
        1), and the learned tree grows from the chain's end. ``min_logps[b]``: request b's confidence
        cut (None: no cut)."""
        p = self.params
        device = req_to_token.device
        batch, k = len(views), p.topk
        guides = guides if guides is not None else [None] * batch
        chains = chains if chains is not None else [[] for _ in views]
        states = [self.states[v.rid] for v in views]
        start_hidden = torch.stack([s.hidden for s in states])
        start_logits = torch.stack([s.logits for s in states])
        if any(chains):
            chains, start_hidden, start_logits = self._advance_chains(views, guides, chains, start_hidden,
                                                                      start_logits, req_to_token)
        committed = torch.tensor([v.committed_len for v in views], dtype=torch.int64, device=device)
        # The learned tree's root is the chain's last token (the root itself without a chain); its
        # children sit at position `base`.
        base = committed + torch.tensor([len(c) for c in chains], dtype=torch.int64, device=device)
        top_ids, top_logp = self._root_children(states, guides, chains, start_logits)
        step_tokens = [top_ids[:, None, :]]  # [B, 1, k]
        step_scores = [top_logp.float()[:, None, :]]
        frontiers: list[torch.Tensor] = []
        cur_tokens = top_ids
        cur_scores = step_scores[0].reshape(batch, k)
        cur_feat = start_hidden[:, None, :].expand(batch, k, -1)
        ancestors = torch.zeros((batch, k, 0), dtype=torch.int64, device=device)  # ancestors' scratch slots
        paths = torch.zeros((batch, k, 0), dtype=torch.int64, device=device)  # frontier paths' tokens
        width = int(base.max()) + p.num_steps
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
                ancestors = torch.cat([ancestors, own], dim=-1)  # [B, k, step]: depth-1 .. depth-step nodes
                paths = torch.cat([paths, cur_tokens[:, :, None]], dim=-1)
                depth = step
                # One row per frontier node: the request's prefix (chain included), then its ancestors.
                table = prefix[:, None, :].expand(batch, k, width).clone()
                # Every frontier node's row gets its own ancestors (an index of shape [B, 1, depth]
                # would scatter into the first node's row only).
                cols = (base[:, None, None] + torch.arange(depth, device=device)[None, None, :]).expand(batch, k, depth)
                table.scatter_(2, cols, ancestors)
                table = table.view(batch * k, width)
                if self.graph is not None and self.graph.capture:  # one graph per bucket: the full width
                    table = torch.cat([table, table.new_zeros(batch * k, req_to_token.shape[1] + p.num_steps - width)], 1)
                inputs = {"ids": cur_tokens.reshape(-1), "positions": (base + depth - 1).repeat_interleave(k),
                          "slots": own.reshape(-1), "table": table, "features": cur_feat.reshape(batch * k, -1)}
                hidden, logits = self.graph(inputs) if self.graph is not None else self._step_forward(inputs)
                logp, child_ids = self._frontier_children(logits, guides, chains, paths)  # [B*k, k] each
                child_ids = child_ids.view(batch, k, k)
                child_scores = cur_scores[:, :, None] + logp.view(batch, k, k)
                step_tokens.append(child_ids)
                step_scores.append(child_scores)
                if step + 1 < p.num_steps:  # pick the next frontier: the k best children overall
                    next_frontier = child_scores.view(batch, k * k).topk(k, dim=-1).indices  # f * k + c
                    parent = next_frontier // k
                    cur_tokens = child_ids.view(batch, k * k).gather(1, next_frontier)
                    cur_scores = child_scores.view(batch, k * k).gather(1, next_frontier)
                    cur_feat = hidden.view(batch, k, -1).gather(1, parent[:, :, None].expand(-1, -1, hidden.shape[-1]))
                    ancestors = ancestors.gather(1, parent[:, :, None].expand(-1, -1, ancestors.shape[-1]))
                    paths = paths.gather(1, parent[:, :, None].expand(-1, -1, paths.shape[-1]))
        finally:
            self.allocator.restore(snapshot)
        cand_tokens, cand_parents, cand_scores = flatten_expansion_steps(step_tokens, step_scores, frontiers)
        roots = torch.tensor([c[-1] if c else r for c, r in zip(chains, root_tokens)], dtype=torch.int64, device=device)
        num_nodes = min(p.tree_nodes, cand_tokens.shape[1] + 1)
        tokens, parents = select_draft_nodes(roots, cand_tokens, cand_parents, cand_scores, num_nodes)
        # The confidence cut: a path's score never grows along it, so the nodes at or above the cut
        # are a prefix of the ranked list, and a prefix is a tree.
        cuts = torch.tensor(min_logps if min_logps is not None else [-math.inf] * batch, device=cand_scores.device)
        keep = (1 + (cand_scores >= cuts[:, None]).sum(-1).clamp(max=num_nodes - 1)).tolist()
        trees = []
        for b, (root, chain) in enumerate(zip(root_tokens, chains)):
            n = keep[b]
            tree_tokens, tree_parents = _hang_below_chain(root, chain, tokens[b, :n].tolist(), parents[b, :n].tolist())
            trees.append((tree_tokens[: p.tree_nodes], tree_parents[: p.tree_nodes]))
        return trees

    def _step_forward(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over frontier rows (each its own single-token request whose table row is
        its prefix, then its ancestors): the head's hidden states and logits per row."""
        positions = inputs["positions"]
        rows = positions.shape[0]
        fb = ForwardBatch.build(
            ForwardMode.DECODE,
            input_ids=inputs["ids"],
            positions=positions,
            out_cache_loc=inputs["slots"],
            req_to_token=inputs["table"],
            req_pool_indices=torch.arange(rows, device=positions.device),
            kv_lens=positions + 1,
            q_lens=torch.ones(rows, dtype=torch.int64, device=positions.device),
            logits="all",
            static_sizes=capture_sizes(self.graph, 1, inputs["table"]),
        )
        return self.head(fb, inputs["features"], self.kv_cache)

    def _advance_chains(self, views: list[DraftView], guides: list[GrammarGuide | None], chains: list[list[int]],
                        hidden: torch.Tensor, logits: torch.Tensor, req_to_token: torch.Tensor
                        ) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """Run the head along each forced chain for as long as it agrees with it; return the chains
        so cut, and the head's hidden state [B, h] and logits [B, K] at each chain's end.

        The forced text is certain, its tokenization is not: under a grammar a model often spells
        a key in pieces ('a', 'rg', 'um', 'ents') where the tokenizer says 'arguments', and a
        chain the target rejects at its first token takes the whole tree down with it. So a
        chain token is kept only while it is the head's own top choice among the grammar-legal
        tokens there; at the first disagreement the learned tree takes over, with the head's
        alternatives (other splits of the same text) as siblings. What the chain still buys is
        depth: its nodes cost no top-k branching, so the tree reaches past ``num_steps``.

        One forward per chain position (each feeds on the previous one's output, as a deeper
        draft node does). The chain's draft KV goes to the request's own slots at positions
        committed .. committed + c - 1, not to scratch: the scheduler reserved them for the
        verify (which writes the target's KV cache, not this one), and the draft extend after
        verification rewrites the accepted positions with the target's features, so no later
        forward reads these guesses."""
        device = req_to_token.device
        hidden, logits = hidden.clone(), logits.clone()
        kept = [0] * len(chains)
        active = [b for b, chain in enumerate(chains) if chain]
        j = 0
        while active:
            agrees = self._head_agrees(logits[active], [guides[b] for b in active],
                                       [chains[b][:j] for b in active], [chains[b][j] for b in active])
            active = [b for b, ok in zip(active, agrees) if ok]
            if not active:
                break
            at = torch.tensor(active, dtype=torch.int64, device=device)
            rows = torch.tensor([views[b].row for b in active], dtype=torch.int64, device=device)
            positions = torch.tensor([views[b].committed_len + j for b in active], dtype=torch.int64, device=device)
            fb = ForwardBatch.build(
                ForwardMode.DECODE,
                input_ids=torch.tensor([chains[b][j] for b in active], dtype=torch.int64, device=device),
                positions=positions,
                out_cache_loc=req_to_token[rows, positions],
                req_to_token=req_to_token,
                req_pool_indices=rows,
                kv_lens=positions + 1,
                q_lens=torch.ones(len(active), dtype=torch.int64, device=device),
                logits="all",
            )
            hidden[at], logits[at] = self.head(fb, hidden[at], self.kv_cache)
            j += 1
            for b in active:
                kept[b] = j
            active = [b for b in active if len(chains[b]) > j]
        return [chain[:n] for chain, n in zip(chains, kept)], hidden, logits

    def _head_agrees(self, logits: torch.Tensor, guides: list[GrammarGuide | None], prefixes: list[list[int]],
                     tokens: list[int]) -> list[bool]:
        """Whether the head puts at least ``CHAIN_MIN_PROB`` of its mass on each token, among what
        the grammar allows after its prefix (unconstrained rows: among everything)."""
        logits = logits.clone()
        guided = [i for i, g in enumerate(guides) if g is not None]
        if guided:
            masks = torch.cat([guides[i].masks_after([prefixes[i]]) for i in guided])
            allowed = bitmask_allows(masks, self._draft_vocab_ids()).to(logits.device)
            logits[guided] = logits[guided].masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(logits, -1)
        best_prob, best = probs.max(-1)
        best = self.head.hot_to_full(best)
        return [int(t) == tok and float(p) >= CHAIN_MIN_PROB for t, p, tok in zip(best.tolist(), best_prob, tokens)]

    def _root_children(self, states: list[DraftState], guides: list[GrammarGuide | None], chains: list[list[int]],
                       start_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k children of each learned tree's root: [B, k] target ids and log-probabilities. An
        unconstrained request without a chain keeps the top-k its draft state already holds."""
        top_ids = torch.stack([s.top_ids for s in states])
        top_logp = torch.stack([s.top_logp for s in states]).float()
        for b, (guide, chain) in enumerate(zip(guides, chains)):
            if guide is None and not chain:
                continue
            logits = start_logits[b][None]
            if guide is not None:
                ids, logp = self._masked_children(logits, guide.masks_after([chain]))
            else:
                logp, idx = torch.log_softmax(logits, -1).topk(self.params.topk, dim=-1)
                ids = self.head.hot_to_full(idx)
            top_ids[b], top_logp[b] = ids[0], logp[0]
        return top_ids, top_logp

    def _frontier_children(self, logits: torch.Tensor, guides: list[GrammarGuide | None], chains: list[list[int]],
                           paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each frontier node's k best children: log-probabilities and target ids [B*k, k]; a guided
        request's rows are restricted to what its grammar allows after the node's path (chain, then
        ``paths[b, f]``)."""
        k = self.params.topk
        guided = [b for b, g in enumerate(guides) if g is not None]
        if len(guided) == len(guides):  # every row guided: nothing to compute over the whole row
            logp = torch.empty((logits.shape[0], k), dtype=torch.float32, device=logits.device)
            ids = torch.empty((logits.shape[0], k), dtype=torch.int64, device=logits.device)
        else:
            logp, idx = torch.log_softmax(logits, -1).topk(k, dim=-1)
            ids = self.head.hot_to_full(idx)
        if guided:
            masks = torch.cat([guides[b].masks_after([chains[b] + path for path in paths[b].tolist()])
                               for b in guided])
            rows = torch.cat([torch.arange(b * k, (b + 1) * k) for b in guided]).to(logits.device)
            ids[rows], logp[rows] = self._masked_children(logits[rows], masks)
        return logp.float(), ids

    def _masked_children(self, logits: torch.Tensor, bitmask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best grammar-allowed tokens of each row and their log-probabilities renormalised over
        the allowed part of the head's vocabulary (target ids, [R, k] each). The renormalisation makes
        a forced token score 0 (probability 1), so deeper nodes under it keep their rank. A row with
        fewer than k allowed tokens fills the rest with -inf scores (on token 0): no path through
        them is ever ranked above a real one, and verification drops them with the grammar's masks."""
        ids, logp, _ = masked_topk_logp(logits, bitmask, self.head.hot_token_ids, self.params.topk)
        return ids.clamp(min=0).to(logits.device), logp.to(logits.device)

    def _draft_vocab_ids(self) -> torch.Tensor:
        """Target token id of each column of the head's logits (on the CPU, where bitmasks live)."""
        if self._vocab_ids is None:
            ids = self.head.hot_token_ids
            self._vocab_ids = (torch.arange(self.head.draft_vocab_size) if ids is None else ids).cpu()
        return self._vocab_ids

    def release(self, rid: str) -> None:
        self.states.pop(rid, None)


def _view(req: SpecInput) -> DraftView:
    return DraftView(req.rid, req.row, req.committed_len)


def _hang_below_chain(root: int, chain: list[int], tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """The full tree: root, the forced chain as nodes 1..c, then the learned tree whose own root
    (``tokens[0]``, the chain's last token) is node c."""
    if not chain:
        return tokens, parents
    c = len(chain)
    return [root] + chain + tokens[1:], [-1] + list(range(c)) + [q + c for q in parents[1:]]
