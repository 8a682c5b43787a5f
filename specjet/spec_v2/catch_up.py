"""Positions a learned drafter has not seen yet: root-only iterations catch it up later, in one call.

A request whose tree is its root alone (a plain step through the verify: free text beside other
requests on a quantized CPU target, ``SpecConfig.free_text_draft_batch``, or its last token) drafts
nothing, yet the drafter's ``after_verify`` would run EAGLE's head or DFlash's context K/V over its
new position every iteration: most of what such an iteration costs beyond plain decoding, and spent
for a draft that may never come. Instead the speculator keeps the position's captured features here
and hands a request's run of them to the drafter when it is about to draft again, or when the run
is ``MAX_PENDING`` long, as one batched catch-up. That is the drafter's ``after_prefill``, whose
contract is exactly this: positions ``committed_len ..`` it has not seen, their features, and the
token after each. The draft state after a catch-up equals the state the per-iteration extends
would have left (the same kernels; tested), so drafts, acceptance and output do not change.

A request that ends with a run pending leaves the draft KV of those positions (fewer than
``MAX_PENDING``) unwritten: its row is reassigned by the time the compute side learns of the end. A
later prefix-cache hit on them drafts from stale draft KV there; output never depends on drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specjet.spec_v2.drafter import SpecInput
from specjet.spec_v2.tree_verifier import VerifyResult

# Positions a request may hold back before it is caught up anyway: long enough that one catch-up
# replaces many per-iteration extends, short enough that the kept features stay small (DFlash's
# are ~14 KB a position on the default model) and an ended request leaves few positions unwritten.
MAX_PENDING = 16


@dataclass
class _Run:
    start: int  # the first position not seen; the run covers start .. start + rows - 1
    features: list[torch.Tensor] = field(default_factory=list)  # [n, F] blocks, in position order
    rows: int = 0


@dataclass(frozen=True)
class CatchUp:
    """One drafter call's worth of catch-up: ``after_prefill(inputs, features, next_tokens, ...)``."""

    inputs: list[SpecInput]
    features: torch.Tensor
    next_tokens: list[int]


class PendingPositions:
    def __init__(self, max_pending: int = MAX_PENDING):
        self.max_pending = max_pending
        self._runs: dict[str, _Run] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._runs

    def pending(self, rid: str) -> int:
        run = self._runs.get(rid)
        return 0 if run is None else run.rows

    def drop(self, rid: str) -> None:
        """Forget a request's run (it ended, or it is prefilled anew)."""
        self._runs.pop(rid, None)

    def before_drafting(self, reqs: list[SpecInput]) -> CatchUp | None:
        """The runs of ``reqs`` (about to draft), taken out: their positions end at ``committed_len``
        and the token after the last one is the root."""
        parts = []
        for r in reqs:
            run = self._runs.pop(r.rid, None)
            if run is not None:
                self._check(r, run)
                parts.append((replace(r, committed_len=run.start, token_ids=r.token_ids[:r.committed_len]),
                              run.features, r.token_ids[r.committed_len]))
        return _catch_up(parts)

    def after_root_only(self, reqs: list[SpecInput], result: VerifyResult) -> CatchUp | None:
        """``reqs`` verified their roots alone (``result`` holds exactly their verify): keep each new
        position's features; the runs that reach ``max_pending`` come back to be caught up now."""
        rows = [offset + n for nodes, offset in zip(result.accepted_nodes, result.node_offsets) for n in nodes]
        # One gather for the batch (a copy: a static verify's output buffer is reused), split per request.
        kept = result.output.hidden[rows].split([len(nodes) for nodes in result.accepted_nodes])
        parts = []
        for r, tokens, features in zip(reqs, result.accepted_tokens, kept):
            run = self._runs.get(r.rid)
            if run is None:
                run = self._runs[r.rid] = _Run(r.committed_len)
            self._check(r, run)
            run.features.append(features)
            run.rows += features.shape[0]
            if run.rows >= self.max_pending:
                del self._runs[r.rid]
                # Positions start .. committed_len + len(tokens) - 1; the tokens after them: the
                # request's own after start, then the accepted ones (the last, the bonus, is next).
                parts.append((replace(r, committed_len=run.start, token_ids=r.token_ids + tokens[:-1]),
                              run.features, tokens[-1]))
        return _catch_up(parts)

    @staticmethod
    def _check(r: SpecInput, run: _Run) -> None:
        if run.start + run.rows != r.committed_len:
            raise RuntimeError(f"request {r.rid!r}: pending draft positions {run.start} .. "
                               f"{run.start + run.rows - 1} do not end before its committed length {r.committed_len}")


def _catch_up(parts: list[tuple[SpecInput, list[torch.Tensor], int]]) -> CatchUp | None:
    if not parts:
        return None
    return CatchUp([p[0] for p in parts], torch.cat([f for p in parts for f in p[1]]), [p[2] for p in parts])
