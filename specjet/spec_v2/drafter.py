"""What every drafter is given and what it provides: the protocol EAGLE, NGRAM, DFLASH and the hybrid
(EAGLE's or DFLASH's trees with an n-gram path) implement, so the speculator (speculator.py) runs any of
them the same way:

    after_prefill -> (propose -> [the target verifies] -> after_verify)* -> release

A drafter keeps per-request state keyed by rid (EAGLE's draft state, a root-context DFlash draft's last
verified context vector, the n-gram index); it sees requests only as ``SpecInput`` values, built on the
compute side from the compute side's own state, and never writes a request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from specjet.grammar import RequestGrammar
from specjet.kernels.penalties import Penalties
from specjet.models.forward_batch import CaptureHidden
from specjet.spec_v2.grammar_guide import GrammarGuide
from specjet.spec_v2.tree_verifier import VerifyResult


@dataclass(frozen=True)
class SpecInput:
    """One request of a speculative iteration, as the compute side knows it."""

    rid: str
    row: int  # its row in the request-to-token table
    committed_len: int  # positions with valid KV; the root goes at this position
    token_ids: list[int]  # prompt and output so far; the last is the root (the last verified token)
    remaining: int  # tokens it may still produce (0: no tree this iteration)
    # Its grammar state after token_ids: the compute side's own copy (a fork of the host's matcher,
    # which the host keeps advancing meanwhile), or None when unconstrained.
    grammar: RequestGrammar | None = None
    coin_key: int | None = None  # its coins for sampling verification (kernels/coins.py); None when greedy
    prompt_len: int = 0  # token_ids[:prompt_len] is the prompt (penalties count the output apart)
    penalties: Penalties | None = None  # applied to every node's logits with its own path's tokens
    logprobs: int | None = None  # asks its tokens' logprobs with this many alternatives; None: does not ask
    prediction: str | list[int] | None = None  # the reply it expects (OpenAI's predicted output): text or ids

    @property
    def root(self) -> int:
        return self.token_ids[-1]


@dataclass(frozen=True)
class DraftRequest:
    """A request as a drafter's ``propose`` sees it."""

    input: SpecInput
    budget: int  # nodes its tree may have, root included (>= 2: the speculator verifies a root alone itself)
    guide: GrammarGuide | None  # grammar-aware drafting: what the grammar allows after any path
    chain: list[int]  # the grammar's forced tokens, to hang under the root as sure nodes ([] if none)
    # The confidence cut of its tree (learned drafts): nodes whose path log-probability under the
    # draft is below it are left out (the grammar's sure tokens score 0).
    min_logp: float = -math.inf
    # Candidates per position of its learned tree where they are not the drafter's own (None: the drafter's).
    width: int | None = None
    # Nodes of its tree, root included, that learned drafts may fill (None: all of ``budget``); the grammar's
    # forced chain and a hybrid's n-gram path may reach past them.
    learned_nodes: int | None = None

    def learned_budget(self) -> int:
        """Nodes its learned tree may have alone: ``learned_nodes`` (never cutting the forced chain), within
        ``budget``."""
        if self.learned_nodes is None:
            return self.budget
        return min(self.budget, max(self.learned_nodes, 1 + len(self.chain)))


# A draft tree: (tokens, parents), root (the last verified token) at node 0 with parent -1, parents
# before children, siblings best first, so any prefix of the node list is itself a tree.
DraftTree = tuple[list[int], list[int]]


class Drafter(Protocol):
    # What the target's prefill and verify forwards capture for this drafter (None: nothing).
    feature_capture: CaptureHidden
    # Whether the draft KV it keeps at a position depends on the token after that position (EAGLE's
    # head reads token t+1 with the feature of t): the prefix cache then never hands a request its
    # match's last position, whose next token may differ from the one the cached KV was made with.
    draft_kv_reads_next_token: bool

    def scratch_slots(self, batch_size: int) -> int:
        """KV slots drafting one batch borrows from the allocator (and gives back)."""

    def after_prefill(self, reqs: list[SpecInput], hidden: torch.Tensor | None, first_tokens: list[int],
                      req_to_token: torch.Tensor) -> None:
        """The target prefilled positions ``committed_len .. len(token_ids) - 1`` of each request
        (``committed_len`` > 0 after a prefix-cache hit or for a later chunk of a long prompt: the
        draft state of the positions before it is in place) and ``first_tokens`` are the tokens
        after them (the sampled first output, or the next prompt token after a chunk that is not
        the prompt's last); ``hidden``: the prefill's captured features of those positions, in
        batch order."""

    def propose(self, reqs: list[DraftRequest], share: int, req_to_token: torch.Tensor) -> list[DraftTree]:
        """One tree per request, of at most ``budget`` nodes. ``share``: the nodes each tree of
        this batch may have before the request's own limits (the verify's cap split evenly).
        Positions ``committed_len`` .. ``committed_len + max_nodes - 1`` (the speculator's
        ``max_nodes``, up to the context's end) of each request's table row hold its own slots: the
        verify writes its tree there, and a drafter may write its own cache's entries there too."""

    def after_verify(self, reqs: list[SpecInput], result: VerifyResult, req_to_token: torch.Tensor) -> None:
        """The target verified the proposed trees: ``result`` holds each request's accepted
        tokens (and bonus) and nodes, and the verify forward's output."""

    def release(self, rid: str) -> None:
        """Forget a request that has ended."""
