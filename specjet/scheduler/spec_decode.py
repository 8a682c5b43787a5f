"""A decode iteration with speculation: draft a tree per request, verify all of them in one target
forward, hand back each request's accepted tokens. The scheduler owns the requests; the drafters
and the verifier (spec_v2) see only ``SpecRequest`` views of them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specjet.grammar import allocate_token_bitmask
from specjet.kernels.sampling import SamplingTensors
from specjet.models.runner import ModelRunner
from specjet.scheduler.request import Req
from specjet.spec_v2.ngram import NgramConfig, NgramDrafter
from specjet.spec_v2.tree_verifier import SpecRequest, TreeVerifier


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
    algorithm: str  # "NGRAM" (EAGLE arrives with its worker)
    num_draft_tokens: int = 8
    ngram: NgramConfig = NgramConfig()


class SpecDecoder:
    def __init__(self, runner: ModelRunner, cfg: SpecConfig, vocab_size: int, context_len: int):
        if cfg.algorithm != "NGRAM":
            raise NotImplementedError(f"speculative_algorithm {cfg.algorithm!r} is not available yet")
        self.cfg = cfg
        self.drafter = NgramDrafter(cfg.ngram)
        self.verifier = TreeVerifier(runner)
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.stats = {"spec_verify_ct": 0, "spec_accepted_tokens": 0}

    @property
    def max_nodes(self) -> int:
        """Positions one iteration may write beyond a request's committed length."""
        return self.cfg.num_draft_tokens

    def tree_budget(self, req: Req) -> int:
        """Nodes this request's tree may have: never more tokens than it may still produce or the
        context can hold; a grammar-constrained request decodes its root only (per-node grammar
        masks arrive with grammar-masked trees)."""
        if req.grammar is not None:
            return 1
        remaining = req.sampling.max_new_tokens - len(req.output_ids)
        room = self.context_len - req.kv_committed_len
        return max(1, min(self.cfg.num_draft_tokens, remaining, room))

    def run(self, reqs: list[Req], req_to_token: torch.Tensor) -> list[list[int]]:
        spec_reqs = []
        for req in reqs:
            self.drafter.observe(req.rid, req.fill_ids)
            tokens, parents = self.drafter.propose(req.rid, self.tree_budget(req))
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
        result = self.verifier.verify(spec_reqs, req_to_token, sampling_tensors(reqs, req_to_token.device))
        for req, accepted in zip(reqs, result.accepted_tokens):
            req.spec_verify_ct += 1
            req.spec_accept_hist[len(accepted)] = req.spec_accept_hist.get(len(accepted), 0) + 1
            self.stats["spec_verify_ct"] += 1
            self.stats["spec_accepted_tokens"] += len(accepted)
        return result.accepted_tokens

    def release(self, req: Req) -> None:
        self.drafter.release(req.rid)
