"""A decode iteration with speculation: draft a tree per request, verify all of them in one target
forward, hand back each request's accepted tokens. The scheduler owns the requests; the drafters
and the verifier (spec_v2) see only views of them.

A grammar-constrained request speculates like any other: its tree is masked node by node with the
grammar state of each node's path and pruned of illegal nodes before verification (always), and
with ``grammar_aware`` its drafts are grammar-legal to begin with and the grammar's forced text
enters the tree as a chain of sure nodes (spec_v2/grammar_guide.py). The grammar's state is left
untouched here: the scheduler advances it by the accepted tokens.

EAGLE trees also hold the request's best n-gram continuation when ``hybrid_ngram_tokens`` > 0 (the
engine's default): the two drafters' trees are merged under the same root (spec_v2/ngram.py
``merge_trees``) and verified as one."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specjet.kernels.sampling import SamplingTensors
from specjet.models.forward_batch import CaptureHidden
from specjet.models.runner import ModelRunner
from specjet.scheduler.request import Req
from specjet.spec_v2.eagle_worker import DraftView, EagleDrafter, EagleParams
from specjet.spec_v2.grammar_guide import GrammarGuide
from specjet.spec_v2.ngram import NgramConfig, NgramDrafter, PathLength, first_path, merge_trees
from specjet.spec_v2.tree_verifier import SpecRequest, TreeVerifier, VerifyResult


def sampling_tensors(reqs: list[Req], device) -> SamplingTensors:
    sps = [r.sampling for r in reqs]
    return SamplingTensors.from_lists(
        [0.0 if sp.is_greedy else sp.temperature for sp in sps],
        [sp.top_k for sp in sps],
        [sp.top_p for sp in sps],
        [sp.min_p for sp in sps],
        device=device,
    )


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str  # "NGRAM" or "EAGLE"
    num_draft_tokens: int = 8  # tree nodes per request, root included (EAGLE's and the hybrid n-gram's)
    ngram: NgramConfig = NgramConfig()
    eagle: EagleParams = EagleParams()
    eagle_head: object = field(default=None, compare=False)  # a loaded EagleDraftModel for "EAGLE"
    grammar_aware: bool = True  # grammar-legal draft top-k and forced continuations as free nodes
    # EAGLE only: each tree also takes the request's best n-gram continuation, up to this many nodes
    # (matched as ``ngram`` says), merged with the learned tree; num_draft_tokens counts both.
    hybrid_ngram_tokens: int = 0
    # Tree nodes per verify across the batch (None: no cap): each request's tree gets an even share.
    max_verify_tokens: int | None = None


class SpecDecoder:
    def __init__(self, runner: ModelRunner, cfg: SpecConfig, vocab_size: int, context_len: int, allocator,
                 tokenizer=None):
        self.cfg = cfg
        # Jump-forward needs the model's tokenizer to turn the grammar's forced text into tokens.
        self._tokenize = None if tokenizer is None else (
            lambda text: tokenizer.encode(text, add_special_tokens=False))
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.path_length = None
        if cfg.algorithm == "NGRAM":
            self.ngram = NgramDrafter(cfg.ngram)
            self.eagle = None
        elif cfg.algorithm == "EAGLE":
            # One n-gram path per tree, as long as the request's recent paths proved (PathLength).
            self.ngram = NgramDrafter(replace(cfg.ngram, num_draft_tokens=cfg.num_draft_tokens, max_branches=1)
                                      ) if cfg.hybrid_ngram_tokens else None
            if cfg.hybrid_ngram_tokens:
                self.path_length = PathLength(cfg.hybrid_ngram_tokens)
            self.eagle = EagleDrafter(runner, cfg.eagle_head, cfg.eagle, allocator)
        else:
            raise NotImplementedError(f"speculative_algorithm {cfg.algorithm!r} is not available")
        self.verifier = TreeVerifier(runner, capture_hidden=self.target_capture)
        # Counted by the scheduler when it commits a verify's tokens (an overlapped iteration for a
        # request that had already finished is not counted).
        self.stats = {"spec_verify_ct": 0, "spec_accepted_tokens": 0}

    @property
    def target_capture(self) -> CaptureHidden:
        """What the target's prefill and verify forwards capture for the drafter (None: nothing)."""
        return self.eagle.head.feature_capture if self.eagle is not None else None

    @property
    def max_nodes(self) -> int:
        """Positions one iteration may write beyond a request's committed length."""
        return self.cfg.num_draft_tokens

    def scratch_slots(self, batch_size: int) -> int:
        return self.eagle.scratch_slots(batch_size) if self.eagle is not None else 0

    def tree_share(self, batch_size: int) -> int:
        """Nodes each tree of a batch may have: ``num_draft_tokens``, or an even share of
        ``max_verify_tokens`` when that is less (two at least: the root and one guess)."""
        cap = self.cfg.max_verify_tokens
        return self.cfg.num_draft_tokens if cap is None else min(self.cfg.num_draft_tokens, max(2, cap // batch_size))

    def tree_budget(self, req: Req, share: int) -> int:
        """Nodes this request's tree may have: its share of the verify (``tree_share``), and never
        more tokens than it may still produce or the context can hold. 0: none at all (the
        compute side, a batch ahead of the host, already took the request to its limit; the host
        finishes it with ``length`` when it sees that batch)."""
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        room = self.context_len - req.kv_committed_len
        return max(0, min(share, remaining, room))

    @staticmethod
    def _view(req: Req) -> DraftView:
        return DraftView(req.rid, req.req_pool_idx, req.kv_committed_len)

    def after_prefill(self, reqs: list[Req], hidden: torch.Tensor, first_tokens: list[int],
                      req_to_token: torch.Tensor) -> None:
        """EAGLE's draft prefill: the head reads (token t+1, target feature t) over each prompt."""
        if self.eagle is None:
            return
        views = [DraftView(r.rid, r.req_pool_idx, 0) for r in reqs]
        token_lists = [r.fill_ids[1:] + [tok] for r, tok in zip(reqs, first_tokens)]
        self.eagle.extend(views, token_lists, hidden, req_to_token)

    def _guide(self, req: Req) -> GrammarGuide | None:
        return GrammarGuide(req.grammar, self.vocab_size, self._tokenize) if req.grammar is not None else None

    def _propose(self, reqs: list[Req], guides: list[GrammarGuide | None], req_to_token: torch.Tensor,
                 share: int, budgets: list[int]
                 ) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], int]] | None]:
        """Each request's tree (``budgets``: its nodes, of the batch's ``share``); for the hybrid also
        its n-gram path (tokens under the root, and how many of them are the forced chain it shares
        with the EAGLE tree), for ``PathLength``."""
        aware = self.cfg.grammar_aware
        chains = [g.forced_chain(n - 1) if aware and g is not None else [] for g, n in zip(guides, budgets)]
        ngram_trees = None
        if self.ngram is not None:
            ngram_trees = []
            for req, guide, chain, budget in zip(reqs, guides, chains, budgets):
                self.ngram.observe(req.rid, req.fill_ids)
                legal_len = guide.legal_prefix_len if aware and guide is not None else None
                if self.eagle is not None:  # hybrid: the chain is the EAGLE tree's too; the path's own length
                    # adapts, and shrinks with the tree's share of the verify
                    limit = self.path_length.limit(req.rid)
                    if share < self.cfg.num_draft_tokens:
                        limit = max(1, limit * share // self.cfg.num_draft_tokens)
                    budget = min(budget, 1 + len(chain) + limit)
                ngram_trees.append(self.ngram.propose(req.rid, budget, chain, legal_len))
            if self.eagle is None:
                return ngram_trees, None
        trees = self.eagle.propose([self._view(r) for r in reqs], [r.output_ids[-1] for r in reqs], req_to_token,
                                   guides=guides if aware else None, chains=chains)
        if ngram_trees is None:
            return [(tokens[:n], parents[:n]) for (tokens, parents), n in zip(trees, budgets)], None
        # hybrid: the n-gram path first, then the learned tree's nodes
        paths = []
        for tree, chain in zip(ngram_trees, chains):
            path = first_path(*tree)
            paths.append((path, len(chain) if path[:len(chain)] == chain else 0))
        return [merge_trees(ngram, tree, n) for ngram, tree, n in zip(ngram_trees, trees, budgets)], paths

    def run(self, reqs: list[Req], req_to_token: torch.Tensor) -> list[list[int]]:
        """Accepted tokens per request ([] for a request with no room left: see ``tree_budget``)."""
        share = self.tree_share(len(reqs))
        budgets = [self.tree_budget(r, share) for r in reqs]
        live = [i for i, n in enumerate(budgets) if n > 0]
        if len(live) == len(reqs):
            return self._run(reqs, req_to_token, share, budgets)
        out: list[list[int]] = [[] for _ in reqs]
        if live:
            accepted = self._run([reqs[i] for i in live], req_to_token, share, [budgets[i] for i in live])
            for i, tokens in zip(live, accepted):
                out[i] = tokens
        return out

    def _run(self, reqs: list[Req], req_to_token: torch.Tensor, share: int, budgets: list[int]) -> list[list[int]]:
        guides = [self._guide(r) for r in reqs]
        trees, ngram_paths = self._propose(reqs, guides, req_to_token, share, budgets)
        spec_reqs = []
        for req, guide, (tokens, parents) in zip(reqs, guides, trees):
            bitmask = None
            if guide is not None:
                tokens, parents, bitmask = guide.mask_tree(tokens, parents)
            uniforms = None
            if req.generator is not None:
                uniforms = torch.rand(len(tokens), generator=req.generator)
            spec_reqs.append(SpecRequest(req.req_pool_idx, req.kv_committed_len, tokens, parents, uniforms, bitmask))
        result = self.verifier.verify(spec_reqs, req_to_token, sampling_tensors(reqs, req_to_token.device),
                                      extra_kv_caches=())
        if ngram_paths is not None:
            for req, (path, shared), accepted in zip(reqs, ngram_paths, result.accepted_tokens):
                taken = next((i for i, (a, b) in enumerate(zip(path, accepted)) if a != b), min(len(path), len(accepted)))
                self.path_length.update(req.rid, len(path) - shared, max(0, taken - shared))
        if self.eagle is not None:
            self._draft_extend(reqs, result, req_to_token)
        return result.accepted_tokens

    def _draft_extend(self, reqs: list[Req], result: VerifyResult, req_to_token: torch.Tensor) -> None:
        """The head runs over the accepted path: at the path's j-th position it reads the token after
        it (the next path token, or the bonus) and the target's hidden state at that node."""
        hidden = result.output.hidden
        rows = torch.cat([torch.tensor(nodes) + off for nodes, off in zip(result.accepted_nodes, result.node_offsets)])
        self.eagle.extend([self._view(r) for r in reqs], result.accepted_tokens, hidden[rows], req_to_token)

    def release(self, req: Req) -> None:
        if self.ngram is not None:
            self.ngram.release(req.rid)
        if self.path_length is not None:
            self.path_length.release(req.rid)
        if self.eagle is not None:
            self.eagle.release(req.rid)
