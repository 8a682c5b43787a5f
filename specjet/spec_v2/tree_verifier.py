"""Verification of draft trees: one target forward over every node, then the accepted path.

Shared by every drafter (EAGLE, n-gram): a drafter proposes (tokens, parents) per request, this
module runs the target over all nodes under the tree mask, walks the tree (greedy or lossless
rejection sampling), and moves the accepted nodes' KV into the request's next positions. It knows
nothing of the scheduler or the drafters: each request arrives as a ``VerifyInput``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specjet.grammar import allocate_token_bitmask, apply_token_bitmask_
from specjet.kernels.penalties import Penalties, apply_penalties_, context_rows
from specjet.kernels.sampling import SamplingTensors, filtered_probs
from specjet.kernels.tree import build_tree
from specjet.kernels.tree_verify import verify_tree_greedy, verify_tree_sampling
from specjet.models.forward_batch import ForwardBatch, ForwardMode, ModelOutput
from specjet.models.runner import ModelRunner


@dataclass
class VerifyInput:
    """One request's draft tree and what verifying it needs."""

    row: int  # the request's row in the request-to-token table
    committed_len: int  # positions with valid KV; the root goes at this position
    tokens: list[int]  # draft tree, root (the last verified token) first
    parents: list[int]  # parent of each node, -1 for the root; parents before children
    uniforms: torch.Tensor | None  # [len(tokens)] coins for sampling verification; None when greedy
    # [len(tokens), W] int32 grammar masks, row i for the token after node i (spec_v2.grammar_guide);
    # None without a grammar
    bitmask: torch.Tensor | None = None
    # (penalties, the tokens before the root's successor (prompt and output, the root last), the
    # prompt's length), or None: node i's logits are penalised as after those tokens and its path.
    penalty: tuple[Penalties, list[int], int] | None = None


@dataclass
class VerifyResult:
    accepted_tokens: list[list[int]]  # per request: accepted draft tokens, then the bonus token
    accepted_nodes: list[list[int]]  # per request: the path's node indices, root first
    output: ModelOutput  # the verify forward's output (hidden states for drafters that need them)
    node_offsets: list[int]  # first row of each request's nodes in the flat forward


class TreeVerifier:
    def __init__(self, runner: ModelRunner, capture_hidden=None, static_nodes: int | None = None):
        self.runner = runner
        self.capture_hidden = capture_hidden
        # Every tree has at most this many nodes: the width a verify is padded to when the runner
        # has static graphs (models/target_graphs.py); None: verifies always run eagerly.
        self.static_nodes = static_nodes

    def verify(self, reqs: list[VerifyInput], req_to_token: torch.Tensor, sampling: SamplingTensors) -> VerifyResult:
        device = req_to_token.device
        sizes = [len(r.tokens) for r in reqs]
        trees = [build_tree(torch.tensor([r.parents], dtype=torch.int64, device=device),
                            torch.tensor([r.committed_len], dtype=torch.int64, device=device)) for r in reqs]
        max_n = max(sizes)
        mask = torch.zeros((len(reqs), max_n, max_n), dtype=torch.bool, device=device)
        for b, (tree, n) in enumerate(zip(trees, sizes)):
            mask[b, :n, :n] = tree.mask[0]
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64, device=device)
        committed = torch.tensor([r.committed_len for r in reqs], dtype=torch.int64, device=device)
        ids = torch.tensor([t for r in reqs for t in r.tokens], dtype=torch.int64, device=device)
        positions = torch.cat([tree.positions[0] for tree in trees])
        slots = torch.cat([req_to_token[r.row, r.committed_len:r.committed_len + n] for r, n in zip(reqs, sizes)])
        q_lens = torch.tensor(sizes, dtype=torch.int64, device=device)
        graphs = self.runner.graphs
        if graphs is not None and self.static_nodes is not None and max_n <= self.static_nodes:
            out = graphs.verify(ids, positions, slots, rows, q_lens, committed + q_lens, mask, self.static_nodes,
                                self.capture_hidden)
        else:
            out = self.runner.forward(ForwardBatch.build(
                ForwardMode.VERIFY,
                input_ids=ids,
                positions=positions,
                out_cache_loc=slots,
                req_to_token=req_to_token,
                req_pool_indices=rows,
                kv_lens=committed + q_lens,
                q_lens=q_lens,
                custom_mask=mask,
                logits="all",
                capture_hidden=self.capture_hidden,
            ))
        logits = out.logits
        offsets = [0]
        for n in sizes[:-1]:
            offsets.append(offsets[-1] + n)
        self._apply_penalties(reqs, logits, offsets)
        self._apply_grammar_masks(reqs, logits, offsets)
        probs = None
        if not sampling.all_greedy:
            nodes = torch.tensor(sizes, device=sampling.temperatures.device)  # each request's row, once per node
            per_node = SamplingTensors(
                temperatures=sampling.temperatures.repeat_interleave(nodes),
                top_ks=sampling.top_ks.repeat_interleave(nodes),
                top_ps=sampling.top_ps.repeat_interleave(nodes),
                min_ps=sampling.min_ps.repeat_interleave(nodes),
                all_greedy=False, need_sort=sampling.need_sort)
            probs = filtered_probs(logits, per_node)
        argmax = logits.argmax(-1)

        accepted_tokens, accepted_nodes = [], []
        for b, (r, tree, n, off) in enumerate(zip(reqs, trees, sizes, offsets)):
            tokens = torch.tensor([r.tokens], dtype=torch.int64, device=device)
            if r.uniforms is None:
                path, lens, bonus = verify_tree_greedy(tokens, tree, argmax[None, off:off + n])
            else:
                # The request's seeded draws are made on the host; the verifier runs where the probs are.
                path, lens, bonus = verify_tree_sampling(tokens, tree, probs[None, off:off + n],
                                                         r.uniforms[None].to(device))
            nodes = path[0, : int(lens[0])].tolist()
            accepted_nodes.append(nodes)
            accepted_tokens.append([r.tokens[i] for i in nodes[1:]] + [int(bonus[0])])
            self._commit_kv(r, nodes, req_to_token)
        return VerifyResult(accepted_tokens, accepted_nodes, out, offsets)

    @staticmethod
    def _apply_penalties(reqs: list[VerifyInput], logits: torch.Tensor, offsets: list[int]) -> None:
        """Each penalised node's logits as plain decoding would penalise them after that node: the
        request's tokens so far plus the draft tokens on the node's path (the root excluded: it is
        the last token so far)."""
        for r, off in zip(reqs, offsets):
            if r.penalty is None:
                continue
            penalties, context, prompt_len = r.penalty
            n = len(r.tokens)
            # The request's tokens so far once, then each node's path (a node's path is its
            # parent's plus its own token: the root is the last token so far, so it adds none).
            counts, seen = context_rows([context], [prompt_len], logits.shape[1], logits.device)
            counts, seen = counts.expand(n, -1).clone(), seen.expand(n, -1).clone()
            for i in range(1, n):
                parent, token = r.parents[i], r.tokens[i]
                counts[i] = counts[parent]
                seen[i] = seen[parent]
                counts[i, token] += 1
                seen[i, token] = True
            with torch.inference_mode():  # the forward's logits are inference tensors
                apply_penalties_(logits[off:off + n], counts, seen, [penalties] * n)

    @staticmethod
    def _apply_grammar_masks(reqs: list[VerifyInput], logits: torch.Tensor, offsets: list[int]) -> None:
        """Mask each constrained node's logits with the grammar state of its own path, in place: the
        greedy walk and the rejection sampling then see, at every node, exactly what plain
        constrained decoding would sample from after that path."""
        rows = [torch.arange(off, off + len(r.tokens)) for r, off in zip(reqs, offsets) if r.bitmask is not None]
        if not rows:
            return
        bitmask = torch.cat([r.bitmask for r in reqs if r.bitmask is not None])
        full = allocate_token_bitmask(logits.shape[0], logits.shape[1])
        full[torch.cat(rows)] = bitmask
        apply_token_bitmask_(logits, full, indices=torch.cat(rows).tolist())

    def _commit_kv(self, r: VerifyInput, nodes: list[int], req_to_token: torch.Tensor) -> None:
        """Node i's KV sits at position committed+i; the j-th node of the path must sit at committed+j.
        Rejected nodes' slots stay reserved for the request and are overwritten next iteration."""
        moves = [(i, j) for j, i in enumerate(nodes) if i != j]
        if not moves:
            return
        base = req_to_token[r.row, r.committed_len:r.committed_len + len(r.tokens)]
        src = base[torch.tensor([i for i, _ in moves])]
        dst = base[torch.tensor([j for _, j in moves])]
        self.runner.kv_cache.move_slots(src, dst)
