"""A decode iteration with speculation: draft a tree per request, verify all of them in one target
forward, hand back each request's accepted tokens. The scheduler owns the requests; the drafters
and the verifier (spec_v2) see only views of them."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specjet.grammar import allocate_token_bitmask
from specjet.kernels.sampling import SamplingTensors
from specjet.models.runner import ModelRunner
from specjet.scheduler.request import Req
from specjet.spec_v2.eagle_worker import DraftView, EagleDrafter, EagleParams
from specjet.spec_v2.ngram import NgramConfig, NgramDrafter
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
    num_draft_tokens: int = 8
    ngram: NgramConfig = NgramConfig()
    eagle: EagleParams = EagleParams()
    eagle_head: object = field(default=None, compare=False)  # a loaded EagleDraftModel for "EAGLE"
    grammar_aware: bool = True  # grammar-legal draft top-k and forced continuations as free nodes


class SpecDecoder:
    def __init__(self, runner: ModelRunner, cfg: SpecConfig, vocab_size: int, context_len: int, allocator):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.context_len = context_len
        if cfg.algorithm == "NGRAM":
            self.ngram = NgramDrafter(cfg.ngram)
            self.eagle = None
        elif cfg.algorithm == "EAGLE":
            self.ngram = None
            self.eagle = EagleDrafter(runner, cfg.eagle_head, cfg.eagle, allocator)
        else:
            raise NotImplementedError(f"speculative_algorithm {cfg.algorithm!r} is not available")
        self.verifier = TreeVerifier(runner, capture_hidden="last" if self.eagle is not None else None)
        # Counted by the scheduler when it commits a verify's tokens (an overlapped iteration for a
        # request that had already finished is not counted).
        self.stats = {"spec_verify_ct": 0, "spec_accepted_tokens": 0}

    @property
    def needs_prefill_hidden(self) -> bool:
        return self.eagle is not None

    @property
    def max_nodes(self) -> int:
        """Positions one iteration may write beyond a request's committed length."""
        return self.cfg.num_draft_tokens

    def scratch_slots(self, batch_size: int) -> int:
        return self.eagle.scratch_slots(batch_size) if self.eagle is not None else 0

    def tree_budget(self, req: Req) -> int:
        """Nodes this request's tree may have: never more tokens than it may still produce or the
        context can hold; a grammar-constrained request decodes its root only (per-node grammar
        masks arrive with grammar-masked trees)."""
        if req.grammar is not None:
            return 1
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        room = self.context_len - req.kv_committed_len
        return max(1, min(self.cfg.num_draft_tokens, remaining, room))

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

    def _propose(self, reqs: list[Req], req_to_token: torch.Tensor) -> list[tuple[list[int], list[int]]]:
        budgets = [self.tree_budget(r) for r in reqs]
        if self.ngram is not None:
            out = []
            for req, budget in zip(reqs, budgets):
                self.ngram.observe(req.rid, req.fill_ids)
                out.append(self.ngram.propose(req.rid, budget))
            return out
        tokens, parents = self.eagle.propose([self._view(r) for r in reqs], [r.output_ids[-1] for r in reqs],
                                             req_to_token)
        return [(tokens[b, :n].tolist(), parents[b, :n].tolist()) for b, n in enumerate(budgets)]

    def run(self, reqs: list[Req], req_to_token: torch.Tensor) -> list[list[int]]:
        spec_reqs = []
        for req, (tokens, parents) in zip(reqs, self._propose(reqs, req_to_token)):
            uniforms = None
            if req.generator is not None:
                uniforms = torch.rand(len(tokens), generator=req.generator)
            root_bitmask = None
            if req.grammar is not None:
                root_bitmask = allocate_token_bitmask(1, self.vocab_size)
                req.grammar.fill_next_token_bitmask(root_bitmask, 0)
                root_bitmask = root_bitmask[0]
            spec_reqs.append(SpecRequest(req.req_pool_idx, req.kv_committed_len, tokens, parents, uniforms,
                                         root_bitmask))
        result = self.verifier.verify(spec_reqs, req_to_token, sampling_tensors(reqs, req_to_token.device),
                                      extra_kv_caches=())
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
        else:
            self.eagle.release(req.rid)
