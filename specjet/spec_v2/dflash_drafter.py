"""DFlash block drafting (a ``Drafter``): one draft forward per iteration proposes a whole chain (or,
with ``topk`` > 1, a tree: each block position's candidates may follow any node of the position
before, the most likely paths first).

Per request the drafter keeps its draft KV (and, for a root-context draft, the context vector of
its last verified position, models/dflash.py): every verified position's context K/V
(models/dflash.py), written at the target's own slot of that position, so the request's row of
the request-to-token table addresses both caches and nothing is allocated for it:

- after prefill: the positions the prefill computed (``committed_len`` .. end), from its captured
  features (earlier positions, a cached prefix or an earlier chunk, are in place already);
- after verify: the root and the accepted draft nodes, from the verify's captured features at those
  nodes (the bonus token has none yet: it is the next root).

Drafting: the block [root, mask x (S - 1)] sits at positions committed .. committed + S - 1 and
attends to the request's visible context positions and all of itself. Position i of the block gives
draft token i, its argmax. Where the block's K/V go:

- in place (the common case): the request's own slots of those positions, which the scheduler holds
  for the verify's tree (``reserved`` positions past the committed length, the speculator's
  ``max_nodes``), in the draft's own cache: a position's draft K/V is rewritten with its context
  K/V once verified, and the draft reads only verified positions. The forward then reads the
  request's own table row: no slots to borrow, no table to build;
- otherwise (a context window, the block past the reserved positions or the context's end, the
  static draft runner): scratch slots borrowed from the allocator (snapshot / restore, as EAGLE's
  tree nodes) and a table row per request built here (visible context slots, then the block's), so
  the window costs nothing: earlier positions are simply not listed.

A node whose path log-probability under the draft (the sum over its positions) is below the request's
cut (``DraftRequest.min_logp``) is not verified: the block's tail is mostly wrong, and every verify row costs a
fraction of a decode step on the CPU.

Under a grammar (grammar-aware drafting) the chain is built left to right: the grammar's forced
tokens first (sure tokens; a draft trained with known prefixes reads them in its block, so the
positions after them draft what follows them), then at each block position the best token the
grammar allows after the chain so far; the block's logits at a position do not depend on the tokens chosen before it
(they are mask tokens in the forward), so one forward still serves the whole walk; a position's
other candidates are its next best tokens legal after that chain. In a lattice tree a path through
a runner-up continues with candidates checked only after the chain: the verify's grammar masks
(grammar/tree_mask.py) drop whatever the grammar forbids there before any row is computed.
"""
from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import torch

from specjet.kernels.cpu_ops import native_attention_available
from specjet.kernels.masked_topk import masked_topk_logp, masked_topk_row
from specjet.models.dflash import DFlashDraftModel
from specjet.models.eagle import FOLLOW_TARGET
from specjet.models.forward_batch import ForwardBatch, ForwardMode
from specjet.models.kv_cache import KVCache
from specjet.models.runner import ModelRunner
from specjet.models.graph_runner import GraphRunner, capture_sizes
from specjet.spec_v2.drafter import DraftRequest, DraftTree, SpecInput
from specjet.spec_v2.grammar_guide import GrammarGuide
from specjet.spec_v2.tree_verifier import VerifyResult


class _BlockConstants(NamedTuple):
    mask: torch.Tensor  # [B, S, S] all true: a block sees all of itself
    logits_rows: torch.Tensor  # [B * (S - 1)] flat rows of block positions 1.. (the drafts)
    offsets: torch.Tensor  # [S] 0 .. S - 1: a block's positions past its root's


class DFlashDrafter:
    """Chains of one block forward from a DFlash draft model (a ``Drafter``)."""

    def __init__(self, runner: ModelRunner, draft: DFlashDraftModel, block_size: int, window: int | None, allocator,
                 topk: int = 1, static: bool = False, cuda_graph: bool = False,
                 quantization: str | None = FOLLOW_TARGET, grammar_topk: int | None = None, forced_tail: bool = True,
                 reserved: int = 0):
        self.runner = runner
        self.draft = draft.bind_target(runner.model, quantization)
        self.feature_capture = self.draft.feature_capture
        # A position's draft KV is its own target feature projected: the token after it plays no
        # part, so the prefix cache may hand out a match's every position.
        self.draft_kv_reads_next_token = False
        self.block_size = block_size
        self.window = window
        self.topk = topk  # candidates per block position: 1 drafts a chain, more a tree (_tree)
        self.grammar_topk = topk if grammar_topk is None else grammar_topk  # the same under a grammar
        self.forced_tail = forced_tail  # under a grammar, the forced text past the block's end (_candidates)
        self.allocator = allocator
        # Positions past a request's committed length whose slots the scheduler holds when it drafts
        # (the verify writes its tree there): a block that fits runs in place (see the module's docstring).
        self.reserved = reserved
        self._block_constants: dict[int, _BlockConstants] = {}  # batch size -> _constants
        cfg = runner.config
        self.kv_cache = KVCache(draft.shape.num_layers, runner.kv_cache.num_slots, cfg.num_kv_heads, cfg.head_dim,
                                runner.dtype, runner.device)
        self.root_ctx: dict[str, torch.Tensor] = {}  # root-context drafts: rid -> c at its last verified position
        # static: the block forward runs on padded static buffers per batch bucket (draft_runner.py).
        self.graph = GraphRunner(
            self._block_forward, {"ids": draft.shape.mask_token_id, "positions": 0, "slots": 0, "table": 0,
                                  "kv_lens": block_size, "root_ctx": 0.0}, runner.device, capture=cuda_graph,
            growing=("table",)) if static else None

    def scratch_slots(self, batch_size: int) -> int:
        """Slots the blocks of one batch borrow (and give back) from the allocator."""
        return self.allocator.slots_needed(0, batch_size * self.block_size)

    # ---------------------------------------------------------------- the Drafter protocol
    def after_prefill(self, reqs: list[SpecInput], hidden: torch.Tensor | None, first_tokens: list[int],
                      req_to_token: torch.Tensor) -> None:
        """Context K/V of the positions the prefill computed (``hidden``: theirs, flat over requests).
        All of them, even those this request's window will never show again: a prefix cache may
        hand them to a later request whose window does (the draft's layers cost little beside the
        target's prefill)."""
        spans = [(r.committed_len, len(r.token_ids)) for r in reqs]
        total = sum(end - start for start, end in spans)
        if hidden is None or hidden.shape[0] != total:
            # The contract: features of positions committed_len .. len(token_ids) - 1, flat over requests.
            raise ValueError(f"after_prefill got features of {None if hidden is None else hidden.shape[0]} "
                             f"positions, the requests computed {total}")
        positions = torch.cat([torch.arange(start, end) for start, end in spans])
        slots = torch.cat([req_to_token[r.row, start:end] for r, (start, end) in zip(reqs, spans)])
        ctx = self._write(hidden, torch.arange(total), positions, slots)
        self._keep_last(reqs, ctx, [end - start for start, end in spans])

    def after_verify(self, reqs: list[SpecInput], result: VerifyResult, req_to_token: torch.Tensor) -> None:
        """Context K/V of the root and the accepted drafts: path node j sits at committed_len + j."""
        # Feature row, position and table row of every accepted node, as one host tensor (a few ints
        # a request: one transfer beats a tensor per request).
        host = torch.tensor([[off + node for nodes, off in zip(result.accepted_nodes, result.node_offsets)
                              for node in nodes],
                             [r.committed_len + j for r, nodes in zip(reqs, result.accepted_nodes)
                              for j in range(len(nodes))],
                             [r.row for r, nodes in zip(reqs, result.accepted_nodes) for _ in nodes]],
                            dtype=torch.int64).to(req_to_token.device, non_blocking=True)
        ctx = self._write(result.output.hidden, host[0], host[1], req_to_token[host[2], host[1]])
        self._keep_last(reqs, ctx, [len(nodes) for nodes in result.accepted_nodes])

    def _write(self, hidden: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
               ) -> torch.Tensor:
        device = self.runner.device
        return self.draft.write_context(hidden[rows.to(hidden.device)], positions.to(device), slots.to(device),
                                        self.kv_cache)

    def _keep_last(self, reqs: list[SpecInput], ctx: torch.Tensor, counts: list[int]) -> None:
        """A root-context draft's state: each request's context at its last verified position."""
        if self.draft.root_proj is None:
            return
        end = 0
        for r, n in zip(reqs, counts):
            end += n
            if n:
                self.root_ctx[r.rid] = ctx[end - 1].clone()

    def propose(self, reqs: list[DraftRequest], share: int, req_to_token: torch.Tensor) -> list[DraftTree]:
        candidates: list[list[list[tuple[int, float]]]] = [[[(t, 0.0)] for t in r.chain[:max(0, r.budget - 1)]]
                                                           for r in reqs]  # forced tokens are sure
        # A block adds drafts after the forced chain only where the chain leaves it positions.
        todo = [b for b, r in enumerate(reqs) if min(r.budget - 1, self.block_size - 1) > len(candidates[b])]
        if todo:
            # A draft trained with known prefixes reads the forced chain in its block (models/dflash.py).
            known = [[c[0][0] for c in candidates[b]] for b in todo] if self.draft.shape.known_prefix else None
            logits = self.draft_blocks([reqs[b].input for b in todo], req_to_token, known)  # [n, S - 1, V]
            for b, block in zip(todo, logits):
                r = reqs[b]
                candidates[b] = self._candidates(r.guide, candidates[b], block, r.budget - 1, r.min_logp, r.width)
        return [_tree(r.input.root, c, r.learned_budget(), r.min_logp) for r, c in zip(reqs, candidates)]

    def release(self, rid: str) -> None:
        # The draft KV lives in the request's own slots, which the scheduler frees.
        self.root_ctx.pop(rid, None)

    # ---------------------------------------------------------------- drafting
    def draft_blocks(self, reqs: list[SpecInput], req_to_token: torch.Tensor,
                     known: list[list[int]] | None = None) -> torch.Tensor:
        """One forward over every request's block; float32 logits [B, S - 1, K or vocab] of positions
        1.. (K: the draft's hot vocabulary, ``draft.hot_to_full`` maps a column to a target id).
        ``known[b]``: tokens that follow request b's root for sure, put in its block in place of
        mask tokens (a draft trained with known prefixes)."""
        device = req_to_token.device
        size, batch = self.block_size, len(reqs)
        if known is not None and not any(known):
            known = None
        if self.graph is None and self.window is None and size <= self.reserved and all(
                r.committed_len + size <= req_to_token.shape[1] for r in reqs):
            return self._in_place_blocks(reqs, req_to_token, known)
        visible = [r.committed_len if self.window is None else min(r.committed_len, self.window) for r in reqs]
        # With CUDA graphs every call passes the widest table the pool can need, so each batch
        # bucket captures one graph; elsewhere the table is as wide as this batch needs.
        width = (req_to_token.shape[1] + size) if self.graph is not None and self.graph.capture \
            else max(visible) + size
        snapshot = self.allocator.snapshot()
        try:
            scratch = self.allocator.extend(torch.empty(0, dtype=torch.int64), 0, batch * size)[:batch * size]
            scratch = scratch.to(device).view(batch, size)
            table = torch.zeros((batch, width), dtype=torch.int64, device=device)
            for b, (r, n) in enumerate(zip(reqs, visible)):
                table[b, :n] = req_to_token[r.row, r.committed_len - n:r.committed_len]
                table[b, n:n + size] = scratch[b]
            ids = self._block_ids(torch.tensor([r.root for r in reqs], dtype=torch.int64, device=device), known)
            committed = torch.tensor([r.committed_len for r in reqs], dtype=torch.int64, device=device)
            inputs = {"ids": ids, "positions": committed[:, None] + self._constants(1, device).offsets,
                      "slots": scratch, "table": table,
                      "kv_lens": torch.tensor(visible, dtype=torch.int64, device=device) + size,
                      "root_ctx": self._root_ctx(reqs, device)}
            (logits,) = self.graph(inputs) if self.graph is not None else self._block_forward(inputs)
        finally:
            self.allocator.restore(snapshot)
        return logits

    def _in_place_blocks(self, reqs: list[SpecInput], req_to_token: torch.Tensor,
                         known: list[list[int]] | None = None) -> torch.Tensor:
        """``draft_blocks`` with each block in its request's own reserved slots, read through its own
        table row (every committed position visible)."""
        device = req_to_token.device
        size, batch = self.block_size, len(reqs)
        root_ctx = self._root_ctx(reqs, device)
        if device.type == "cpu" and native_attention_available():
            # The C++ block input and layer stack from host lists (no metadata tensors built here).
            logits = self.draft.native_block_logits([r.root for r in reqs], root_ctx, [r.committed_len for r in reqs],
                                                    [r.row for r in reqs], size, req_to_token, self.kv_cache,
                                                    self._constants(batch, device).mask, known)
            if logits is not None:
                return logits
        host = torch.tensor([[r.row for r in reqs], [r.committed_len for r in reqs], [r.root for r in reqs]],
                            dtype=torch.int64).to(device, non_blocking=True)
        rows, committed, roots = host[0], host[1], host[2]
        ids = None if known is None else self._block_ids(roots, known)
        positions = committed[:, None] + self._constants(1, device).offsets
        slots = req_to_token[rows[:, None], positions]
        inputs = {"ids": self._block_ids(roots) if ids is None else ids, "positions": positions, "slots": slots,
                  "table": req_to_token, "rows": rows, "kv_lens": committed + size, "root_ctx": root_ctx}
        return self._block_forward(inputs)[0]

    def _block_forward(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """The draft over blocks ``inputs["ids"]`` [B, S]: row ``inputs["rows"][b]`` of the table
        (row b without "rows") lists block b's visible context slots, then its ``slots``; the block
        sees all of itself. A row of the padding the draft runner adds (mask ids, slot 0, a KV length
        of one block) reads and writes only the padding slot. Logits of block positions 1.. [B, S - 1,
        K or vocab]."""
        ids = inputs["ids"]
        batch, size = ids.shape
        device = ids.device
        constants = self._constants(batch, device)
        fb = ForwardBatch.build(
            ForwardMode.VERIFY,  # several new tokens under a caller-given mask
            input_ids=ids.reshape(-1),
            positions=inputs["positions"].reshape(-1),
            out_cache_loc=inputs["slots"].reshape(-1),
            req_to_token=inputs["table"],
            req_pool_indices=inputs["rows"] if "rows" in inputs else torch.arange(batch, device=device),
            kv_lens=inputs["kv_lens"],
            q_lens=torch.full((batch,), size, dtype=torch.int64, device=device),
            custom_mask=constants.mask,  # the non-causal block
            logits=constants.logits_rows,  # position 0 (the root) drafts nothing
            static_sizes=capture_sizes(self.graph, size, inputs["table"]),
        )
        root_ctx = inputs["root_ctx"] if self.draft.root_proj is not None else None
        return (self.draft(fb, self.kv_cache, root_ctx).view(batch, size - 1, -1),)

    def _block_ids(self, roots: torch.Tensor, known: list[list[int]] | None = None) -> torch.Tensor:
        """[B, S] block ids: each root, its known tokens (at most S - 1), then mask ids."""
        ids = self.draft.root_block_ids(roots, self.block_size)
        for b, tokens in enumerate(known or ()):
            tokens = tokens[:self.block_size - 1]
            if tokens:
                ids[b, 1:1 + len(tokens)] = torch.tensor(tokens, dtype=torch.int64, device=roots.device)
        return ids

    def _constants(self, batch: int, device) -> "_BlockConstants":
        """A batch of blocks' index tensors, made once per batch size (read-only; kept alive for a
        captured graph that reads them)."""
        if batch not in self._block_constants:
            size = self.block_size
            starts = torch.arange(batch, device=device) * size
            offsets = torch.arange(size, device=device)
            self._block_constants[batch] = _BlockConstants(
                mask=torch.ones((batch, size, size), dtype=torch.bool, device=device),
                logits_rows=(starts[:, None] + offsets[1:]).reshape(-1),
                offsets=offsets)
        return self._block_constants[batch]

    def _root_ctx(self, reqs: list[SpecInput], device) -> torch.Tensor:
        """[B, h] each request's last verified context (zeros for a draft without a root context)."""
        if self.draft.root_proj is None:
            return torch.zeros((len(reqs), 1), dtype=self.runner.dtype, device=device)
        ctx = [self.root_ctx[r.rid] for r in reqs]  # kept on the device (_keep_last)
        return ctx[0][None] if len(ctx) == 1 else torch.stack(ctx)

    def _candidates(self, guide: GrammarGuide | None, forced: list[list[tuple[int, float]]], logits: torch.Tensor,
                    want: int, min_logp: float = -math.inf, width: int | None = None
                    ) -> list[list[tuple[int, float]]]:
        """Per draft position after the forced ones: the draft's ``topk`` (or ``width``) best (token, log-prob),
        best first; under a grammar its ``grammar_topk`` (or ``width``) best among the tokens the grammar allows after
        the chain of best tokens before (renormalised over them). Stops where nothing is allowed (the
        grammar has ended), at the block's end, at ``want`` positions or, under a grammar, at the position
        where the best path falls below ``min_logp`` (the cut ``_tree`` applies)."""
        out = list(forced)
        stop = min(want, logits.shape[0])
        if guide is None:  # every position at once: nothing depends on the tokens chosen before
            if len(out) < stop:
                ids, logp, _ = masked_topk_logp(logits[len(out):stop], None, self.draft.hot_token_ids,
                                                width or self.topk)
                out += [[(t, lp) for t, lp in zip(row_ids, row_logp) if t >= 0]
                        for row_ids, row_logp in zip(ids.tolist(), logp.tolist())]
            return out
        # The best path to a position is the chain of best tokens (the spine), so once the spine's
        # log-probability falls below the cut no path reaches further (_tree stops there): the walk stops.
        spine, cut = sum(c[0][1] for c in out), False
        with guide.walk([c[0][0] for c in out]) as walk:  # the chain of best tokens, grown in turn
            while len(out) < stop:
                best, _ = masked_topk_row(logits[len(out)], walk.mask(), self.draft.hot_token_ids,
                                          width or self.grammar_topk)
                if not best:  # nothing allowed (the grammar has ended), or no allowed logit is finite
                    break
                out.append(best)  # fewer than topk where fewer legal tokens are finite
                spine += best[0][1]
                cut = spine < min_logp
                if cut:
                    break
                walk.take(best[0][0])
            if self.forced_tail and not cut and len(out) == logits.shape[0] and len(out) < want:
                # Past the block's end the grammar's forced text is still a sure guess (jump-forward
                # after the chain of best tokens): verify rows, but no draft forward.
                out += [[(t, 0.0)] for t in walk.forced_chain(want - len(out))]
        return out


def _tree(root: int, candidates: list[list[tuple[int, float]]], budget: int, min_logp: float = -math.inf
          ) -> DraftTree:
    """The draft tree of a block, best first: every node at depth i may continue with any of block
    position i + 1's candidates (a block position's prediction does not depend on the token chosen
    before it, so after a runner-up the next positions' drafts are as good a guess as after the
    best token: a lattice, of which the spine of best tokens is one path). Paths are expanded in
    order of log-probability (the sum over their positions) until ``budget - 1`` nodes are taken or
    the next is below ``min_logp`` (the grammar's sure tokens score 0). A child never scores above
    its parent and is only queued once its parent is taken, so the nodes come parents first and any
    cut of the list is a tree. With one candidate per position this is the chain of the spine."""
    tokens, parents = [root], [-1]
    # (-score, depth, order queued, parent index, token): ties go to the shallower, then the earlier node
    queue = [(-logp, 0, rank, 0, token) for rank, (token, logp) in enumerate(candidates[0])] if candidates else []
    heapq.heapify(queue)
    queued = len(queue)
    while queue and len(tokens) < budget:
        neg, depth, _, parent, token = heapq.heappop(queue)
        if -neg < min_logp:
            break
        tokens.append(token)
        parents.append(parent)
        if depth + 1 < len(candidates):
            node = len(tokens) - 1
            for token_next, logp in candidates[depth + 1]:
                heapq.heappush(queue, (neg - logp, depth + 1, queued, node, token_next))
                queued += 1
    return tokens, parents
