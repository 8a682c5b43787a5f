"""Verification of draft trees: one target forward over every node, then the accepted path.

Shared by every drafter (EAGLE, n-gram): a drafter proposes (tokens, parents) per request, this module runs
the target over all nodes under the tree mask, walks the tree (greedy, or each node's token drawn as plain
decoding draws it with the coin of its position: kernels/tree_verify.py), and moves the accepted nodes' KV
into the request's next positions. It knows nothing of the scheduler or the drafters: each request arrives as
a ``VerifyInput``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specjet.grammar import apply_token_bitmask_, empty_token_bitmask
from specjet.kernels.logprobs import log_softmax_rows
from specjet.kernels.logprobs import logged as _logged
from specjet.kernels.argmax import argmax_rows
from specjet.kernels.masked_topk import masked_argmax
from specjet.kernels.penalties import Penalties, add_bias_, apply_penalties_, context_rows, hold_stops_
from specjet.kernels.sampling import SamplingTensors, filtered_probs, sampling_rows
from specjet.kernels.tree import build_tree
from specjet.kernels.tree_verify import verify_tree_greedy, verify_tree_sampling, verify_trees_sampling_cpu
from specjet.models.forward_batch import ModelOutput, host_token_tensors
from specjet.models.runner import ModelRunner


@dataclass
class VerifyInput:
    """One request's draft tree and what verifying it needs."""

    row: int  # the request's row in the request-to-token table
    committed_len: int  # positions with valid KV; the root goes at this position
    tokens: list[int]  # draft tree, root (the last verified token) first
    parents: list[int]  # parent of each node, -1 for the root; parents before children
    # [len(tokens)] float32, the coin of each depth (the token after a node of depth d takes position committed_len
    # + 1 + d: kernels/coins.py) for sampling verification; None when greedy
    uniforms: torch.Tensor | None
    # [len(tokens), W] int32 grammar masks, row i for the token after node i (spec_v2.grammar_guide);
    # None without a grammar
    bitmask: torch.Tensor | None = None
    # (penalties, the tokens before the root's successor (prompt and output, the root last), the
    # prompt's length), or None: node i's logits are penalised as after those tokens and its path.
    penalty: tuple[Penalties, list[int], int] | None = None
    # The request asks its tokens' logprobs with this many alternatives (None: it does not): its nodes' logits
    # are then computed over the whole vocabulary, and each accepted token's row gives its logprobs.
    logprobs: int | None = None


@dataclass
class VerifyResult:
    accepted_tokens: list[list[int]]  # per request: accepted draft tokens, then the bonus token
    accepted_nodes: list[list[int]]  # per request: the path's node indices, root first
    output: ModelOutput  # the verify forward's output (hidden states for drafters that need them)
    node_offsets: list[int]  # first row of each request's nodes in the flat forward

    def select(self, keep: list[int]) -> "VerifyResult":
        """The result of some of its requests (their rows in ``output`` unchanged)."""
        return VerifyResult([self.accepted_tokens[i] for i in keep], [self.accepted_nodes[i] for i in keep],
                            self.output, [self.node_offsets[i] for i in keep])


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
        max_n = max(sizes)
        # The trees' shapes are built on the host from the parents lists (a few dozen nodes: Python
        # beats a kernel launch and a read-back per request on a GPU, and a loop of torch ops on a CPU)
        # and go to the device as one mask, one id/position tensor and one slot gather.
        ancestors = [_ancestors(r.parents) for r in reqs]  # a node's depth is its ancestors' count
        graphs = self.runner.graphs
        static = graphs is not None and self.static_nodes is not None and max_n <= self.static_nodes
        # Through the graphs the mask is built at their width (no second, padded copy on the device).
        # Roots alone need none: the forward is a plain decode step's.
        mask = (None if max_n == 1 and not static else
                _tree_masks(ancestors, self.static_nodes if static else max_n).to(device, non_blocking=True))
        tokens = [t for r in reqs for t in r.tokens]
        depths = [r.committed_len + len(a) - 1 for r, nodes in zip(reqs, ancestors) for a in nodes]
        slot_cols = [r.committed_len + i for r, n in zip(reqs, sizes) for i in range(n)]
        offsets = offsets_of(sizes)
        grammar = self._grammar_masks(reqs, len(tokens), self.runner.config.vocab_size, offsets)
        logged = [i for i, r in enumerate(reqs) if r.logprobs is not None]
        head_mask = grammar if grammar is None or not logged else _unmask_requests(grammar, logged, offsets, sizes)
        rows, kv_lens = [r.row for r in reqs], [r.committed_len + n for r, n in zip(reqs, sizes)]
        if static:
            ids, positions, slots = host_token_tensors(
                req_to_token, tokens, depths, [r.row for r, n in zip(reqs, sizes) for _ in range(n)], slot_cols)
            per_request = torch.tensor([rows, [r.committed_len for r in reqs], sizes],
                                       dtype=torch.int64).to(device, non_blocking=True)
            rows_t, committed, q_lens = per_request[0], per_request[1], per_request[2]
            out = graphs.verify(ids, positions, slots, rows_t, q_lens, committed + q_lens, mask, self.static_nodes,
                                self.capture_hidden)
        else:
            out = self.runner.forward_lists(tokens, depths, slot_cols, rows, sizes, kv_lens, req_to_token,
                                            custom_mask=mask, capture_hidden=self.capture_hidden,
                                            logits_mask=head_mask, argmax_rows=self._argmax_only(reqs, sizes))
        logits = out.logits
        # A greedy walk reads the logits of unpenalised requests without changing them: their accepted rows alone
        # are taken after it. Otherwise every node row of those requests, now, before the penalties and masks
        # below change the logits in place: (the flat rows, their log-softmax).
        early = None
        if logged and not (sampling.all_greedy and all(reqs[i].penalty is None for i in logged)):
            early_rows = [offsets[i] + k for i in logged for k in range(sizes[i])]
            early = (early_rows, log_softmax_rows(logits, early_rows))
        self._apply_penalties(reqs, logits, offsets)
        if sampling.all_greedy:
            # The one read-back of a greedy verify; under a grammar the masked argmax reads only the columns
            # each node's mask allows (the logits stay unmasked: nothing reads them after the walk).
            argmax = (argmax_rows(logits) if grammar is None else masked_argmax(logits, *grammar)).tolist()
            paths = [_greedy_path(r.tokens, r.parents, argmax[off:off + len(r.tokens)]) for r, off in zip(reqs, offsets)]
        else:
            paths = self._sampled_paths(reqs, logits, offsets, sizes, sampling, device, grammar)
        accepted_tokens = [[r.tokens[i] for i in nodes[1:]] + [bonus] for r, (nodes, bonus) in zip(reqs, paths)]
        accepted_nodes = [nodes for nodes, _ in paths]
        if logged:
            _log_accepted(reqs, logged, logits, offsets, accepted_nodes, accepted_tokens, early)
        self._commit_kv(reqs, accepted_nodes, req_to_token)
        return VerifyResult(accepted_tokens, accepted_nodes, out, offsets)

    def _argmax_only(self, reqs: list[VerifyInput], sizes: list[int]) -> torch.Tensor | None:
        """bool, one per node row: the rows only the greedy walk reads (a greedy request without penalties or
        logprobs), which the head may compute only where their argmax can be
        (``LlamaForCausalLM.head_logits``); None where no row is such or the head has no such path."""
        if getattr(self.runner.model, "argmax_bound", None) is None:
            return None
        flags = [r.uniforms is None and r.penalty is None and r.logprobs is None for r in reqs]
        if not any(flags):
            return None
        return torch.tensor([f for f, n in zip(flags, sizes) for _ in range(n)], dtype=torch.bool)

    @staticmethod
    def _sampled_paths(reqs: list[VerifyInput], logits: torch.Tensor, offsets: list[int], sizes: list[int],
                       sampling: SamplingTensors, device, grammar=None) -> list[tuple[list[int], int]]:
        """Each request's accepted path and bonus token, every node's token drawn as plain decoding draws it
        with the coin of its depth (kernels/tree_verify.py; greedy requests of a mixed batch walk their argmax),
        where the probabilities are. On the CPU the sampled requests' trees are walked in C++, a node's row
        filtered only when the path reaches it and read through its grammar mask as plain decoding reads it;
        elsewhere every node's filtered distribution is built."""
        paths: list[tuple[list[int], int] | None] = [None] * len(reqs)
        on = sampling.temperatures.device
        sampled = [i for i, r in enumerate(reqs) if r.uniforms is not None]
        walked = sampled and verify_trees_sampling_cpu(
            logits, [offsets[i] for i in sampled], [reqs[i].tokens for i in sampled], [reqs[i].parents for i in sampled],
            [reqs[i].uniforms for i in sampled], sampling_rows(sampling, torch.tensor(sampled, device=on)), grammar)
        for i, path in zip(sampled, walked or []):
            paths[i] = path
        rest = [i for i in range(len(reqs)) if paths[i] is None]
        if not rest:
            return paths
        # The other requests' node rows, each request's parameters once per node; their grammar masks written into
        # them (the C++ walk reads a mask as it goes, as plain decoding's draw does, and writes none).
        rows = [offsets[i] + j for i in rest for j in range(sizes[i])]
        if grammar is not None:
            bitmask, masked = grammar
            rows_t = torch.tensor(rows, device=masked.device)
            apply_token_bitmask_(logits, bitmask, indices=rows_t[masked[rows_t]].tolist())
        if len(rows) < logits.shape[0]:
            logits = logits[rows]
        reqs, sizes = [reqs[i] for i in rest], [sizes[i] for i in rest]
        offsets = offsets_of(sizes)
        node_rows = torch.tensor([i for i, n in zip(rest, sizes) for _ in range(n)], device=on)
        per_node = sampling_rows(sampling, node_rows)
        probs = filtered_probs(logits, per_node)
        argmax = argmax_rows(logits)
        for i, r, n, off in zip(rest, reqs, sizes, offsets):
            tokens = torch.tensor([r.tokens], dtype=torch.int64, device=device)
            tree = build_tree(torch.tensor([r.parents], dtype=torch.int64, device=device),
                              torch.tensor([r.committed_len], dtype=torch.int64, device=device))
            if r.uniforms is None:
                path, lens, bonus = verify_tree_greedy(tokens, tree, argmax[None, off:off + n])
            else:
                # The request's seeded draws are made on the host; the verifier runs where the probs are.
                path, lens, bonus = verify_tree_sampling(tokens, tree, probs[None, off:off + n],
                                                         r.uniforms[None].to(device))
            paths[i] = (path[0, : int(lens[0])].tolist(), int(bonus[0]))
        return paths

    @staticmethod
    def _apply_penalties(reqs: list[VerifyInput], logits: torch.Tensor, offsets: list[int]) -> None:
        """Each penalised node's logits as plain decoding would penalise them after that node: the
        request's tokens so far plus the draft tokens on the node's path (the root excluded: it is
        the last token so far); then its logit bias; then its stop tokens, where the output up to the node is
        shorter than its min_new_tokens."""
        for r, off in zip(reqs, offsets):
            if r.penalty is None:
                continue
            penalties, context, prompt_len = r.penalty
            n = len(r.tokens)
            # The output before each node's successor: the tokens so far, and the node's depth in draft tokens.
            depths = [0] * n
            for i in range(1, n):
                depths[i] = depths[r.parents[i]] + 1
            output_lens = [len(context) - prompt_len + d for d in depths]
            if not penalties.contextual:  # a logit bias alone: the same for every node
                with torch.inference_mode():
                    add_bias_(logits[off:off + n], [penalties] * n)
                    hold_stops_(logits[off:off + n], [penalties] * n, output_lens)
                continue
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
                apply_penalties_(logits[off:off + n], counts, seen, [penalties] * n, output_lens)

    @staticmethod
    def _grammar_masks(reqs: list[VerifyInput], rows: int, vocab_size: int,
                       offsets: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The bitmask of every logits row ([rows, W] int32) and which rows it constrains ([rows] bool), or
        None: each constrained node's mask is the grammar state of its own path, so the greedy walk and the
        sampled draws see, at every node, exactly what plain constrained decoding would sample from
        after that path. Rows of unconstrained requests are left unfilled (never read)."""
        constrained = [(r, off) for r, off in zip(reqs, offsets) if r.bitmask is not None]
        if not constrained:
            return None
        bitmask = empty_token_bitmask(rows, vocab_size)
        masked = torch.zeros(rows, dtype=torch.bool)
        for r, off in constrained:
            bitmask[off:off + len(r.tokens)] = r.bitmask
            masked[off:off + len(r.tokens)] = True
        return bitmask, masked

    def _commit_kv(self, reqs: list[VerifyInput], paths: list[list[int]], req_to_token: torch.Tensor) -> None:
        """Node i's KV sits at position committed+i; the j-th node of the path must sit at committed+j.
        Rejected nodes' slots stay reserved for the request and are overwritten next iteration. One
        gather and one copy for the whole batch (requests' slots are disjoint, and within a request
        every source is read before any destination is written)."""
        rows, src, dst = [], [], []
        for r, nodes in zip(reqs, paths):
            for j, i in enumerate(nodes):
                if i != j:
                    rows.append(r.row)
                    src.append(r.committed_len + i)
                    dst.append(r.committed_len + j)
        if not rows:
            return
        index = torch.tensor([rows, src, dst], dtype=torch.int64).to(req_to_token.device, non_blocking=True)
        self.runner.kv_cache.move_slots(req_to_token[index[0], index[1]].to(torch.int64),
                                        req_to_token[index[0], index[2]].to(torch.int64))


def _log_accepted(reqs: list[VerifyInput], logged: list[int], logits: torch.Tensor, offsets: list[int],
                  accepted_nodes: list[list[int]], accepted_tokens: list[list[int]],
                  early: tuple[list[int], torch.Tensor] | None) -> None:
    """The logged requests' accepted runs as ``LoggedTokens``: token j was decided by the row of the path's node j,
    read from ``early`` (rows taken before the walk) or, without it, from the unchanged logits."""
    path_rows = {i: [offsets[i] + node for node in accepted_nodes[i]] for i in logged}
    if early is None:
        rows = [row for i in logged for row in path_rows[i]]
        early = (rows, log_softmax_rows(logits, rows))
    rows, logprobs = early
    where = {row: k for k, row in enumerate(rows)}
    for i in logged:
        accepted_tokens[i] = _logged(accepted_tokens[i], logprobs[[where[row] for row in path_rows[i]]],
                                     reqs[i].logprobs)


def _unmask_requests(grammar: tuple[torch.Tensor, torch.Tensor], requests: list[int], offsets: list[int],
                     sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The verify's grammar masks for the LM head with these requests' rows left unconstrained: their logits
    are computed over the whole vocabulary (the walk still reads their masks)."""
    bitmask, masked = grammar
    masked = masked.clone()
    for i in requests:
        masked[offsets[i]:offsets[i] + sizes[i]] = False
    return bitmask, masked


def offsets_of(sizes: list[int]) -> list[int]:
    """Where each request's nodes start among the verify's rows."""
    offsets = [0]
    for n in sizes[:-1]:
        offsets.append(offsets[-1] + n)
    return offsets


def _tree_masks(trees: list[list[list[int]]], width: int) -> torch.Tensor:
    """[B, width, width] bool on the host: entry (b, i, j) is set when node j of tree b is node i or one
    of its ancestors (``trees``: each tree's ``_ancestors``)."""
    index: list[list[int]] = [[], [], []]  # (tree, node, ancestor) of every set entry
    for b, nodes in enumerate(trees):
        for i, ancestors in enumerate(nodes):
            index[0].extend([b] * len(ancestors))
            index[1].extend([i] * len(ancestors))
            index[2].extend(ancestors)
    mask = torch.zeros((len(trees), width, width), dtype=torch.bool)
    mask[tuple(torch.tensor(ix) for ix in index)] = True
    return mask


def _ancestors(parents: list[int]) -> list[list[int]]:
    """Each node's ancestors and itself (parents come before their children)."""
    out: list[list[int]] = [[0]]
    for i in range(1, len(parents)):
        out.append(out[parents[i]] + [i])
    return out


def _greedy_path(tokens: list[int], parents: list[int], target: list[int]) -> tuple[list[int], int]:
    """The greedy walk (``tree_verify.verify_tree_greedy``'s rule) on host lists: from the root, move
    to the first child in draft order whose token is the target's argmax after the current node; the
    argmax where no child matches is the bonus token. Returns (path nodes, root first; bonus)."""
    children: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].append(i)
    path = [0]
    while True:
        want = target[path[-1]]
        nxt = next((c for c in children[path[-1]] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
