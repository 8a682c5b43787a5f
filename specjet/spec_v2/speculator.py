"""A decode iteration with speculation: draft a tree per request, verify all of them in one target
forward, hand back each request's accepted tokens.

It runs on the compute side (the model worker calls it) and sees requests as ``SpecInput`` values;
the drafter (EAGLE, NGRAM, the EAGLE + n-gram hybrid, or DFLASH's block drafter) is any ``Drafter``
(drafter.py).

A grammar-constrained request speculates like any other: its tree is masked node by node with the
grammar state of each node's path and pruned of illegal nodes before verification (always), and
with ``grammar_aware`` its drafts are grammar-legal to begin with and the grammar's forced text
enters the tree as a chain of sure nodes (grammar_guide.py). The grammar it reads is the compute
side's own copy of the request's state (``SpecInput.grammar``); every accept made here on it is
rolled back, and the host advances its own matcher by the accepted tokens.
"""
from __future__ import annotations

import pathlib
import time
from dataclasses import replace
from typing import Callable

import torch

from specjet.kernels.coins import coins
from specjet.kernels.sampling import SamplingTensors
from specjet.models.dflash import default_dflash_path, load_dflash
from specjet.models.eagle import default_eagle_path, draft_method, load_eagle
from specjet.models.forward_batch import CaptureHidden
from specjet.models.runner import ModelRunner
from specjet.spec_v2.catch_up import CatchUp, PendingPositions
from specjet.spec_v2.config import SpecConfig
from specjet.spec_v2.dflash_drafter import DFlashDrafter
from specjet.spec_v2.drafter import DraftRequest, Drafter, SpecInput
from specjet.spec_v2.eagle_drafter import EagleDrafter
from specjet.spec_v2.grammar_guide import GrammarGuide
from specjet.spec_v2.hybrid import HybridDrafter
from specjet.spec_v2.ngram import NgramDrafter
from specjet.spec_v2.payoff import DraftPayoff
from specjet.spec_v2.prediction import TokenText
from specjet.spec_v2.tree_verifier import TreeVerifier, VerifyInput, VerifyResult


def draft_model_dir(cfg: SpecConfig):
    """The directory the EAGLE head or DFlash draft loads from: ``cfg.draft_model_path`` (``~`` expanded, as
    ``model_path``'s is), else the one shipped for the default model; None for drafters without a model or with one
    handed in."""
    given = pathlib.Path(cfg.draft_model_path).expanduser() if cfg.draft_model_path else None
    if cfg.algorithm == "EAGLE" and cfg.eagle_head is None:
        return given or default_eagle_path()
    if cfg.algorithm == "DFLASH" and cfg.dflash_draft is None:
        return given or default_dflash_path()
    return None


def make_drafter(cfg: SpecConfig, runner: ModelRunner, allocator) -> Drafter:
    """The drafter ``cfg`` names (the EAGLE head or DFlash draft loaded from ``draft_model_dir``)."""
    if cfg.algorithm == "NGRAM":
        return NgramDrafter(cfg.ngram)
    if cfg.algorithm == "EAGLE":
        head = cfg.eagle_head
        if head is None:
            import pathlib

            head_dir = draft_model_dir(cfg)
            if not pathlib.Path(head_dir).exists():
                raise FileNotFoundError(f"EAGLE draft head not found at {head_dir}")
            head = load_eagle(head_dir, runner.config, dtype=runner.dtype, device=runner.device,
                              quantization=draft_method(runner.model, cfg.draft_quantization))
        eagle = EagleDrafter(runner, head, cfg.eagle, allocator, *cfg.runner_mode(runner.device),
                             quantization=cfg.draft_quantization)
        if not cfg.hybrid_path_nodes:
            return eagle
        return HybridDrafter(eagle, NgramDrafter(replace(cfg.ngram, max_branches=1)), cfg.hybrid_path_nodes,
                             cfg.max_tree_nodes)
    if cfg.algorithm == "DFLASH":
        draft = cfg.dflash_draft
        if draft is None:
            import pathlib

            draft_dir = draft_model_dir(cfg)
            if not pathlib.Path(draft_dir).exists():
                raise FileNotFoundError(f"DFlash draft model not found at {draft_dir} "
                                        "(train one with `python -m specjet.train dflash`)")
            draft = load_dflash(draft_dir, runner.config, dtype=runner.dtype, device=runner.device,
                                quantization=draft_method(runner.model, cfg.draft_quantization))
        dflash = DFlashDrafter(runner, draft, cfg.dflash.block_size, cfg.dflash.window, allocator, cfg.dflash.topk,
                               *cfg.runner_mode(runner.device),
                               quantization=cfg.draft_quantization, grammar_topk=cfg.dflash.grammar_topk,
                               forced_tail=cfg.dflash.forced_tail, reserved=cfg.max_tree_nodes)
        if not cfg.hybrid_path_nodes:
            return dflash
        return HybridDrafter(dflash, NgramDrafter(replace(cfg.ngram, max_branches=1)), cfg.hybrid_path_nodes,
                             cfg.max_tree_nodes)
    raise ValueError(f"speculative_algorithm {cfg.algorithm!r} is not available")


class Speculator:
    def __init__(self, cfg: SpecConfig, runner: ModelRunner, allocator, context_len: int,
                 tokenize: Callable[[str], list[int]] | None = None,
                 token_bytes: Callable[[], list[bytes]] | None = None):
        self.cfg = cfg
        # Jump-forward turns the grammar's forced text into tokens with the grammar backend's split (its cache).
        self._tokenize = tokenize
        self.vocab_size = runner.config.vocab_size
        self.context_len = context_len
        self.draft_model_dir = draft_model_dir(cfg)  # None: a head handed in, or no draft model
        self.drafter = make_drafter(cfg, runner, allocator)
        ngram = self.drafter if isinstance(self.drafter, NgramDrafter) else getattr(self.drafter, "ngram", None)
        if isinstance(ngram, NgramDrafter) and token_bytes is not None and tokenize is not None:
            ngram.token_text = TokenText(token_bytes, self._tokenize)  # for predictions given as text
        self.verifier = TreeVerifier(runner, capture_hidden=self.drafter.feature_capture,
                                     static_nodes=cfg.max_tree_nodes)
        # A learned drafter sees the positions of root-only trees later, in one call (catch_up.py).
        self.pending = PendingPositions() if self.drafter.feature_capture is not None else None
        self.payoff = DraftPayoff() if cfg.measured_payoff else None
        self.timings = PhaseTimings()
        # Beside guided drafting: DFLASH for a request without a grammar or a prediction that has decoded alone
        # since its prefill (``SpecConfig.solo``). Its draft state covers every position only while each of the
        # request's iterations is one of its own; the first that is not (here, or a plain step on the host's
        # side, which keeps it out of speculative batches from then on) makes it stale for good.
        self.solo = None
        if cfg.solo is not None:
            self.solo = Speculator(cfg.solo, runner, allocator, context_len, tokenize, token_bytes)
            self.solo.timings = self.timings  # one account of the phases
        self._stale: set[str] = set()

    # ---------------------------------------------------------------- geometry (pure: config only)
    @property
    def target_capture(self) -> CaptureHidden:
        """What the target's prefill and verify forwards capture for the drafter (None: nothing)."""
        return self.drafter.feature_capture if self.solo is None else self.solo.target_capture

    @property
    def draft_kv_reads_next_token(self) -> bool:
        """See ``Drafter.draft_kv_reads_next_token`` (the prefix cache's rule for a match's end)."""
        return self.drafter.draft_kv_reads_next_token or (self.solo is not None and self.solo.draft_kv_reads_next_token)

    @property
    def drafts_ngrams(self) -> bool:
        """Whether its trees take n-gram continuations (and so a request's prediction's)."""
        return self.cfg.algorithm == "NGRAM" or self.cfg.hybrid_path_nodes > 0

    @property
    def guided_only(self) -> bool:
        """Only requests with a prediction or a grammar draft (an engine without ``speculative_algorithm``)."""
        return self.cfg.guided_only

    def drafts_for(self, prediction, constrained: bool) -> bool:
        """Whether a request with this prediction (None: none), under a grammar or not, may get a tree beyond
        its root."""
        return not self.cfg.guided_only or bool(prediction) or constrained or self.solo is not None

    @property
    def drafts_alone_only(self) -> bool:
        """A request without a grammar or a prediction drafts only while it has decoded alone since its prefill
        (``SpecConfig.solo``): the host keeps such a request out of speculative batches once it decodes beside
        others."""
        return self.solo is not None

    def stopped_drafting(self, rid: str) -> bool:
        """Whether a request that may draft alone (``drafts_alone_only``) no longer does: its drafting measured
        slower than plain steps, or it had an iteration beside others."""
        return rid in self._stale

    @property
    def max_nodes(self) -> int:
        """Positions one iteration may write beyond a request's committed length."""
        return self.cfg.max_tree_nodes if self.solo is None else max(self.cfg.max_tree_nodes, self.solo.max_nodes)

    def scratch_slots(self, batch_size: int) -> int:
        own = self.drafter.scratch_slots(batch_size)
        return own if self.solo is None or batch_size != 1 else max(own, self.solo.scratch_slots(1))

    def tree_share(self, batch_size: int) -> int:
        """Nodes each tree of a batch may have: ``max_tree_nodes``, or an even share of
        ``max_verify_nodes`` when that is less (two at least: the root and one guess)."""
        cap = self.cfg.max_verify_nodes
        return self.cfg.max_tree_nodes if cap is None else min(self.cfg.max_tree_nodes, max(2, cap // batch_size))

    def tree_budget(self, req: SpecInput, share: int) -> int:
        """Nodes this request's tree may have: its share of the verify (``tree_share``), and never
        more tokens than it may still produce or the context can hold. 0: none at all (the
        compute side, a batch ahead of the host, already took the request to its limit; the host
        finishes it when it sees that batch)."""
        return max(0, min(share, req.remaining, self.context_len - req.committed_len))

    # ---------------------------------------------------------------- the iteration
    def after_prefill(self, reqs: list[SpecInput], hidden: torch.Tensor | None, first_tokens: list[int],
                      req_to_token: torch.Tensor, guided: list[bool] | None = None) -> None:
        """``guided``: per request, whether it brings a prediction or decodes under a grammar (None: none does)."""
        if self.pending is not None:
            for r in reqs:  # a request prefilled anew (after a retraction) starts its draft state over
                self.pending.drop(r.rid)
        self.drafter.after_prefill(reqs, hidden, first_tokens, req_to_token)
        if self.solo is not None:
            self._solo_prefill(reqs, hidden, first_tokens, req_to_token, guided or [False] * len(reqs))

    def _solo_prefill(self, reqs: list[SpecInput], hidden: torch.Tensor | None, first_tokens: list[int],
                      req_to_token: torch.Tensor, guided: list[bool]) -> None:
        """The solo drafter's state for the free-text requests of a prefill. A guided request never drafts with
        it, so its prompt gets no draft KV (a later free-text request that finds that prompt in the prefix cache
        drafts from stale draft KV there; output never depends on drafts)."""
        keep = [i for i, g in enumerate(guided) if not g]
        if len(keep) == len(reqs):
            self.solo.after_prefill(reqs, hidden, first_tokens, req_to_token)
        elif keep:
            rows = hidden.split([len(r.token_ids) - r.committed_len for r in reqs])
            self.solo.after_prefill([reqs[i] for i in keep], torch.cat([rows[i] for i in keep]),
                                    [first_tokens[i] for i in keep], req_to_token)

    def run(self, reqs: list[SpecInput], sampling: SamplingTensors, req_to_token: torch.Tensor) -> list[list[int]]:
        """Accepted tokens per request ([] for a request with no room left: see ``tree_budget``).
        ``sampling``: the batch's sampling parameters, one row per request."""
        if self.solo is not None:
            alone = reqs[0] if len(reqs) == 1 else None
            if alone is not None and alone.grammar is None and not alone.prediction and alone.rid not in self._stale:
                out = self.solo.run(reqs, sampling, req_to_token)
                payoff = self.solo.payoff
                if payoff is not None and payoff.judged_slower(alone.rid):
                    # Drafting measured slower at its context: plain steps to its end (the host reads
                    # ``stopped_drafting``), which cost less than the verify's root-only iterations of a pause.
                    self._stale.add(alone.rid)
                    self.solo.release(alone.rid)
                return out
            for r in reqs:  # the solo drafter does not see this iteration: its state no longer covers them
                if r.rid not in self._stale:
                    self._stale.add(r.rid)
                    self.solo.release(r.rid)
        share = self.tree_share(len(reqs))
        budgets = [self.tree_budget(r, share) for r in reqs]
        limit = self.cfg.free_text_draft_batch
        # A request with a grammar (whose forced text is sure) or a prediction (the caller's claim that drafting
        # pays) is left to draft.
        if limit is not None and len(reqs) > limit:  # free text verifies its root alone (a plain step)
            budgets = [min(n, 1) if r.grammar is None and not r.prediction else n for r, n in zip(reqs, budgets)]
        # Alone and without a grammar, a request drafts while drafting measures faster than plain steps.
        judged = (reqs[0] if self.payoff is not None and len(reqs) == 1 and reqs[0].grammar is None
                  and not reqs[0].prediction else None)
        if judged is not None and budgets[0] > 1 and not self.payoff.wants_draft(judged.rid, judged.committed_len):
            budgets = [1]
        start = time.perf_counter()
        live = [i for i, n in enumerate(budgets) if n > 0]
        out: list[list[int]] = [[] for _ in reqs]
        if live:
            if len(live) < len(reqs):
                sampling = _rows(sampling, live)
            accepted = self._run([reqs[i] for i in live], sampling, req_to_token, share, [budgets[i] for i in live])
            for i, tokens in zip(live, accepted):
                out[i] = tokens
            if judged is not None:
                self.payoff.record(judged.rid, judged.committed_len, budgets[0] > 1, len(out[0]),
                                   time.perf_counter() - start)
        return out

    def _run(self, reqs: list[SpecInput], sampling: SamplingTensors, req_to_token: torch.Tensor, share: int,
             budgets: list[int]) -> list[list[int]]:
        clock = self.timings.start()
        aware = self.cfg.grammar_aware
        guides = [GrammarGuide(r.grammar, self.vocab_size, self._tokenize) if r.grammar is not None else None
                  for r in reqs]
        drafts = [DraftRequest(r, n, g if aware else None, g.forced_chain(n - 1) if aware and g is not None else [],
                               self.cfg.min_draft_logp(len(reqs), r.grammar is not None),
                               self.cfg.draft_width(len(reqs), r.grammar is not None),
                               self.cfg.learned_nodes(len(reqs)))
                  for r, g, n in zip(reqs, guides, budgets)]
        clock.lap("grammar")
        drafting = [d for d in drafts if d.budget > 1]  # a budget of 1 is the root alone: nothing to draft
        if self.pending is not None and drafting:
            self._catch_up(self.pending.before_drafting([d.input for d in drafting]), req_to_token)
            clock.lap("draft_extend")
        drafted = iter(self.drafter.propose(drafting, share, req_to_token) if drafting else [])
        trees = [next(drafted) if d.budget > 1 else ([d.input.root], [-1]) for d in drafts]
        clock.lap("draft")
        verify_inputs = []
        for req, guide, (tokens, parents) in zip(reqs, guides, trees):
            bitmask = None
            if guide is not None:
                tokens, parents, bitmask = guide.mask_tree(tokens, parents)
            # The coin of each depth: a node of depth d is followed by the token at position len(token_ids) + d.
            uniforms = None if req.coin_key is None else torch.tensor(
                coins(req.coin_key, len(req.token_ids), len(tokens)), dtype=torch.float32)
            penalty = None if req.penalties is None else (req.penalties, req.token_ids, req.prompt_len)
            verify_inputs.append(VerifyInput(req.row, req.committed_len, tokens, parents, uniforms, bitmask, penalty,
                                             req.logprobs))
        clock.lap("grammar")
        result = self.verifier.verify(verify_inputs, req_to_token, sampling)
        clock.lap("verify")
        self._after_verify(reqs, budgets, result, req_to_token)
        clock.lap("draft_extend")
        self.timings.finish(sum(len(v.tokens) for v in verify_inputs), len(verify_inputs))
        return result.accepted_tokens

    def _after_verify(self, reqs: list[SpecInput], budgets: list[int], result: VerifyResult,
                      req_to_token: torch.Tensor) -> None:
        """The drafter extends over what the drafting requests accepted; a root-only tree's position
        (the drafter never saw that request this iteration) waits for a catch-up (catch_up.py)."""
        drafted = [i for i, n in enumerate(budgets) if n > 1]
        if len(drafted) == len(reqs):
            self.drafter.after_verify(reqs, result, req_to_token)
            return
        if drafted:
            self.drafter.after_verify([reqs[i] for i in drafted], result.select(drafted), req_to_token)
        if self.pending is not None:
            alone = [i for i, n in enumerate(budgets) if n <= 1]
            self._catch_up(self.pending.after_root_only([reqs[i] for i in alone], result.select(alone)),
                           req_to_token)

    def _catch_up(self, work: CatchUp | None, req_to_token: torch.Tensor) -> None:
        if work is not None:
            self.drafter.after_prefill(work.inputs, work.features, work.next_tokens, req_to_token)

    def release(self, rid: str) -> None:
        if self.solo is not None:
            self.solo.release(rid)
            self._stale.discard(rid)
        if self.pending is not None:
            self.pending.drop(rid)
        if self.payoff is not None:
            self.payoff.drop(rid)
        self.drafter.release(rid)


PHASES = ("grammar", "draft", "verify", "draft_extend")


class PhaseTimings:
    """Where a speculative iteration's time goes, host wall time per phase: grammar (guides, the
    forced chain, the tree's masks), draft (the drafter's propose), verify (the target forward and
    the accept walk), draft_extend (the drafter's after_verify). On CUDA a phase's time is what the
    host spent in it (kernels run on asynchronously); on the CPU it is the phase's compute. Beside
    them, the nodes the verifies held: on the CPU a verify's cost grows with its nodes, so a tree
    setting's acceptance reads against them."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.iterations = 0
        self.nodes = self.trees = 0

    def start(self) -> "_Clock":
        return _Clock(self.seconds)

    def finish(self, nodes: int = 0, trees: int = 0) -> None:
        """One iteration done, whose verify held ``nodes`` tree nodes (roots included) of ``trees`` requests."""
        self.iterations += 1
        self.nodes += nodes
        self.trees += trees

    def summary(self, reset: bool = False) -> dict:
        """Mean milliseconds per iteration of each phase, the iterations counted, and the mean nodes of one
        request's verify tree, root included (``tree_nodes``)."""
        n = self.iterations
        out = {"iterations": n, **{f"{p}_ms": (1e3 * s / n if n else 0.0) for p, s in self.seconds.items()},
               "tree_nodes": self.nodes / self.trees if self.trees else 0.0}
        if reset:
            self.reset()
        return out


class _Clock:
    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now


def _rows(st: SamplingTensors, rows: list[int]) -> SamplingTensors:
    """The sampling parameters of some requests of a batch."""
    return SamplingTensors.from_lists(*(t[rows].tolist() for t in (st.temperatures, st.top_ks, st.top_ps, st.min_ps)),
                                      device=st.temperatures.device)
