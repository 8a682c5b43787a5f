"""The compute side: a batch's tensors, the forward, sampling, speculation.

Everything in this file runs on the compute stream (the overlap loop's worker thread; inline in
the plain loop), and nothing outside it does: the scheduler hands the worker a ``WorkerBatch`` of
``ReqInput`` values and gets each request's new tokens back through a future. The worker keeps its
own state of each running request (``ComputeState``: tokens and committed length), a batch ahead
of the host's in the overlap loop: batch N+1 is launched before the host has seen N's tokens, and
its forward reads them here. Streams run work in order, so N+1's work always finds N's results.

The worker never writes a request (the scheduler alone does) and never touches a request's grammar
matcher: plain batches get their grammar masks from the host, and a speculative batch gets a fork
of each matcher (``ReqInput.grammar``), which it brings up to date with the tokens the host has not
seen yet.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from specjet.grammar import RequestGrammar, apply_token_bitmask_
from specjet.kernels.argmax import argmax_rows
from specjet.kernels.coins import coin
from specjet.kernels.logprobs import LoggedTokens, log_softmax_rows, logged
from specjet.kernels.masked_topk import masked_argmax
from specjet.kernels.penalties import apply_penalties_, context_rows
from specjet.kernels.sampling import SamplingTensors, cpu_sampler_serves, sample, sample_lists
from specjet.models.forward_batch import ModelOutput
from specjet.models.runner import ModelRunner
from specjet.scheduler.batch import BatchKind
from specjet.scheduler.sampling_params import SamplingParams
from specjet.spec_v2.drafter import SpecInput
from specjet.spec_v2.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReqInput:
    """One request of a launched batch, as the scheduler hands it to the worker."""

    rid: str
    row: int  # its row in the request-to-token table
    sampling: SamplingParams
    # Its coin key when sampled (kernels/coins.py): the token at position p is drawn with coin(key, p), p read
    # from the compute state (ahead of the host's in the overlap loop).
    coin_key: int | None
    # Prefill only: the request's tokens (the prompt and any output from before a retraction), of
    # which this batch computes the KV of positions [cached_len, prefill_end) (None: to the end);
    # positions before cached_len have theirs (a cached prefix, or earlier chunks). Only a prefill
    # that reaches the end samples a token; the compute state starts from the tokens computed.
    prefill_ids: list[int] | None = None
    prompt_len: int = 0
    cached_len: int = 0
    prefill_end: int | None = None
    # Speculative decode only: a fork of the request's grammar matcher when it had taken the
    # request's first ``grammar_len`` output tokens (the host's state at launch), or None.
    grammar: RequestGrammar | None = None
    grammar_len: int = 0
    # A plain decode: the request decodes under a grammar (the host sends its mask with the sampling).
    constrained: bool = False
    # Speculative decode: it verifies its root alone this iteration (its tree did not fit the pool; Req.root_only).
    root_only: bool = False


@dataclass
class WorkerBatch:
    kind: BatchKind
    inputs: list[ReqInput]
    # Requests that ended since the last batch: their drafter state goes before this batch runs.
    released: tuple[str, ...] = ()


@dataclass
class ComputeState:
    """What the compute side knows of one request: possibly ahead of the host by a batch."""

    rid: str
    tokens: list[int]  # prompt, then output
    prompt_len: int
    committed_len: int  # positions with valid KV

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.prompt_len


def _prefill_end(inp: ReqInput) -> int:
    return len(inp.prefill_ids) if inp.prefill_end is None else inp.prefill_end


def _prompt_positions(inp: ReqInput) -> list[int]:
    """The prompt positions whose token's logprob this prefill (chunk) can give and the request asks for: the row
    before each is among the computed ones (the first position has no row before it)."""
    start = inp.sampling.logprob_start_len
    if start < 0:
        return []
    return list(range(max(start, 1, inp.cached_len + 1), min(inp.prompt_len, _prefill_end(inp) + 1)))


def _samples(kind: BatchKind, inp: ReqInput) -> bool:
    """Whether this request gets a token from the batch (a prefill chunk before the last does not)."""
    return kind is BatchKind.DECODE or _prefill_end(inp) == len(inp.prefill_ids)


class ModelWorker:
    def __init__(self, runner: ModelRunner, req_to_token: torch.Tensor, speculator: Speculator | None):
        self.runner = runner
        self.req_to_token = req_to_token
        self.speculator = speculator
        self.device = runner.device
        self._states: dict[str, ComputeState] = {}
        # A plain decode batch under a grammar leaves the LM head to its sampling, which has the masks: a
        # row whose grammar allows few tokens then costs those columns, not the whole head (runner.head).
        self._defer_head = runner.device.type == "cpu" and runner.head_takes_masks

    # ---------------------------------------------------------------- work items (run on the stream)
    def forward(self, batch: WorkerBatch) -> ModelOutput:
        """A plain batch's forward: prefill (starting each request's compute state) or decode."""
        self.release(batch.released)
        if batch.kind is BatchKind.PREFILL:
            for inp in batch.inputs:
                self._states[inp.rid] = ComputeState(inp.rid, inp.prefill_ids[:_prefill_end(inp)], inp.prompt_len,
                                                     inp.cached_len)
            capture = self.speculator.target_capture if self.speculator is not None else None
            return self._prefill(batch.inputs, capture)
        return self._decode_forward([self._state(inp) for inp in batch.inputs], batch.inputs)

    def sample(self, batch: WorkerBatch, forward: Future, grammar_mask) -> list[list[int]]:
        """Each request's next token from the forward's logits, masked by the host-built grammar
        bitmask ``(bitmask, rows)`` (or None); advances the compute states. A prefill chunk before
        the prompt's last gets no token ([]), and draws none of its request's coins."""
        out: ModelOutput = forward.result()
        sampled = [i for i, inp in enumerate(batch.inputs) if _samples(batch.kind, inp)]
        logged_rows = [i for i in sampled if batch.inputs[i].sampling.return_logprob]
        masked = flags = None
        if grammar_mask is not None:
            rows = set(grammar_mask[1])
            flags = [i in rows for i in range(len(batch.inputs))]
            masked = torch.tensor(flags, dtype=torch.bool)
        logits = out.logits
        states = [self._state(inp) for inp in batch.inputs]
        if logits is None:  # the head was left to this step (ModelWorker._defer_head)
            start = time.perf_counter()
            head_mask = None
            if grammar_mask is not None:  # rows that report logprobs need every column
                head_mask = (grammar_mask[0], torch.tensor([f and i not in logged_rows for i, f in enumerate(flags)],
                                                           dtype=torch.bool) if logged_rows else masked)
            logits = self.runner.head(out.hidden, head_mask, self._argmax_only(batch.inputs, states))
            out.head_seconds = time.perf_counter() - start
        # Before the masks and penalties below change the logits in place.
        logprobs = log_softmax_rows(logits, logged_rows) if logged_rows else None
        penalised = [i for i, (inp, s) in enumerate(zip(batch.inputs, states)) if _penalties_now(inp, s) is not None]
        tokens: list[int | None] = [None] * len(batch.inputs)
        if (grammar_mask is not None and not penalised and logits.device.type == "cpu"
                and all(inp.sampling.is_greedy for inp in batch.inputs)):
            # Greedy under a grammar: the masked argmax in one pass, the mask never written into the logits.
            best = masked_argmax(logits, grammar_mask[0], masked).tolist()
            for i in sampled:
                tokens[i] = best[i]
        elif (not penalised and len(sampled) == len(batch.inputs)
              and not all(inp.sampling.is_greedy for inp in batch.inputs)
              and (drawn := self._draw_on_host(batch.inputs, states, logits,
                                               None if grammar_mask is None else (grammar_mask[0], flags))) is not None):
            # A decode step's draw in one C++ call, a grammar's mask read as it goes (not written into the logits).
            tokens = drawn
        else:
            if grammar_mask is not None:  # on the logits' device: a verify masks and draws there too
                bitmask, rows = grammar_mask
                apply_token_bitmask_(logits, bitmask, indices=rows)
            if penalised:
                self._penalise(logits, [states[i] for i in penalised], [batch.inputs[i] for i in penalised],
                               penalised)
            if len(sampled) < len(batch.inputs):
                logits = logits[sampled]
            if sampled:
                # The masks go along (already written into the logits) so that a constrained row is read as the
                # branch above and a speculative verify read it: its draw is theirs, bit for bit.
                grammar = None if grammar_mask is None else (grammar_mask[0][sampled], [flags[i] for i in sampled])
                for i, token in zip(sampled, self._sample_tokens([batch.inputs[i] for i in sampled],
                                                                 [states[i] for i in sampled], logits, grammar)):
                    tokens[i] = token
        if batch.kind is BatchKind.PREFILL and self.speculator is not None:
            # After a chunk, the token after its last position is the next prompt token.
            nexts = [inp.prefill_ids[len(s.tokens)] if t is None else t for s, inp, t in zip(states, batch.inputs, tokens)]
            spec_inputs = [SpecInput(s.rid, inp.row, inp.cached_len, s.tokens, 0) for s, inp in zip(states, batch.inputs)]
            self.speculator.after_prefill(spec_inputs, out.hidden, nexts, self.req_to_token,
                                          [inp.sampling.guided for inp in batch.inputs])
        for state, token in zip(states, tokens):
            state.committed_len = len(state.tokens) if batch.kind is BatchKind.PREFILL else state.committed_len + 1
            if token is not None:
                state.tokens.append(token)
        new_tokens = [[] if t is None else [t] for t in tokens]
        for k, i in enumerate(logged_rows):
            new_tokens[i] = logged(new_tokens[i], logprobs[k:k + 1], batch.inputs[i].sampling.top_logprobs_num)
        for i, entries in (out.prompt_logprobs or {}).items():  # handed on with the request's token (or none)
            if not isinstance(new_tokens[i], LoggedTokens):
                new_tokens[i] = LoggedTokens(new_tokens[i], [], [])
            new_tokens[i].inputs = entries
        return new_tokens

    def speculate(self, batch: WorkerBatch) -> list[list[int]]:
        """One speculative decode iteration: draft, verify, accept. The root and the accepted draft
        nodes now have KV, and the bonus token is the next root."""
        self.release(batch.released)
        states = [self._state(inp) for inp in batch.inputs]
        spec_inputs = []
        for inp, state in zip(batch.inputs, states):
            remaining = inp.sampling.max_new_tokens - state.num_outputs
            if inp.root_only:  # a tree of one node: the root, whose verify gives the next token
                remaining = min(remaining, 1)
            grammar = inp.grammar
            if grammar is not None and not _catch_up(grammar, state.tokens[state.prompt_len + inp.grammar_len:]):
                remaining = 0  # it has ended here (the host finishes it when it sees the tokens)
            spec_inputs.append(SpecInput(inp.rid, inp.row, state.committed_len, state.tokens, remaining, grammar,
                                         inp.coin_key, state.prompt_len, _penalties_now(inp, state),
                                         inp.sampling.top_logprobs_num if inp.sampling.return_logprob else None,
                                         inp.sampling.prediction))
        new_tokens = self.speculator.run(spec_inputs, sampling_tensors([i.sampling for i in batch.inputs], self.device),
                                         self.req_to_token)
        for state, tokens in zip(states, new_tokens):
            state.committed_len += len(tokens)
            state.tokens.extend(tokens)
        return new_tokens

    # ---------------------------------------------------------------- helpers
    def _state(self, inp: ReqInput) -> ComputeState:
        state = self._states.get(inp.rid)
        if state is None:
            raise RuntimeError(f"request {inp.rid!r} has no compute-side state (was it prefilled?)")
        return state

    def release(self, rids) -> None:
        """Drop the compute-side state of these ended requests (their compute state, the drafter's). A drafter that
        fails to drop one request's state fails neither the batch this rides on nor the other requests' drops."""
        for rid in rids:
            self._states.pop(rid, None)
            if self.speculator is not None:
                try:
                    self.speculator.release(rid)
                except Exception:  # noqa: BLE001
                    logger.exception("dropping the draft state of request %r failed", rid)

    def _prefill(self, inputs: list[ReqInput], capture) -> ModelOutput:
        """Extend every request from its cached length to the end of its prefill ids (logits of its last row;
        the prompt logprobs of the requests that ask, from every row they need)."""
        ids, positions, q_lens, kv_lens = [], [], [], []
        for inp in inputs:
            start, end = inp.cached_len, _prefill_end(inp)
            ids.extend(inp.prefill_ids[start:end])
            positions.extend(range(start, end))
            q_lens.append(end - start)
            kv_lens.append(end)
        asked = {i: ps for i, inp in enumerate(inputs) if (ps := _prompt_positions(inp))}
        if not asked:
            return self.runner.forward_lists(ids, positions, positions, [inp.row for inp in inputs], q_lens, kv_lens,
                                             self.req_to_token, capture_hidden=capture, last_logits=True)
        # The LM head over the rows the asking requests score and each request's last row: not its neighbours'.
        firsts = [sum(q_lens[:i]) for i in range(len(inputs))]
        scored = {i: [firsts[i] + p - 1 - inputs[i].cached_len for p in ps] for i, ps in asked.items()}
        lasts = [first + n - 1 for first, n in zip(firsts, q_lens)]
        logit_rows = sorted({*lasts, *(r for rows in scored.values() for r in rows)})
        at = {row: k for k, row in enumerate(logit_rows)}
        out = self.runner.forward_lists(ids, positions, positions, [inp.row for inp in inputs], q_lens, kv_lens,
                                        self.req_to_token, capture_hidden=capture, logit_rows=logit_rows)
        out.prompt_logprobs = {}
        for i, ps in asked.items():
            inp = inputs[i]
            tokens = logged([inp.prefill_ids[p] for p in ps], log_softmax_rows(out.logits, [at[r] for r in scored[i]]),
                            inp.sampling.top_logprobs_num)
            out.prompt_logprobs[i] = {p: (lp, top) for p, lp, top in zip(ps, tokens.logprobs, tokens.tops)}
        out.logits = out.logits[[at[row] for row in lasts]]
        return out

    def _decode_forward(self, states: list[ComputeState], inputs: list[ReqInput]) -> ModelOutput:
        """Feed each request's last token at position committed_len (through the target's graphs
        where the runner has them)."""
        if self.runner.graphs is not None:  # the batch's numbers go to the device as one tensor
            return self.runner.graphs.decode(torch.tensor(
                [[s.tokens[-1], s.committed_len, inp.row] for s, inp in zip(states, inputs)], dtype=torch.int64))
        committed = [s.committed_len for s in states]
        return self.runner.forward_lists([s.tokens[-1] for s in states], committed, committed,
                                         [inp.row for inp in inputs], [1] * len(states), [n + 1 for n in committed],
                                         self.req_to_token,
                                         defer_logits=self._defer_head and any(inp.constrained for inp in inputs),
                                         argmax_rows=self._argmax_only(inputs, states))

    def _argmax_only(self, inputs: list[ReqInput], states: list[ComputeState]) -> torch.Tensor | None:
        """bool, one per request of a decode batch: the rows whose logits only an argmax reads (greedy, no
        penalties or logit bias, no logprobs), which the head may compute only where their argmax can be
        (``LlamaForCausalLM.head_logits``); None where no row is such or the head has no such path."""
        if getattr(self.runner.model, "argmax_bound", None) is None:
            return None
        flags = [inp.sampling.is_greedy and _penalties_now(inp, s) is None and not inp.sampling.return_logprob
                 for inp, s in zip(inputs, states)]
        return torch.tensor(flags, dtype=torch.bool) if any(flags) else None

    def _penalise(self, logits: torch.Tensor, states: list[ComputeState], inputs: list[ReqInput],
                  rows: list[int]) -> None:
        """Penalties (and logit biases, and stop tokens held back by min_new_tokens) on the given rows of a plain
        batch's logits, from each request's tokens so far."""
        penalties = [_penalties_now(inp, s) for inp, s in zip(inputs, states)]
        counts = seen = None
        if any(p.contextual for p in penalties):
            counts, seen = context_rows([s.tokens for s in states], [s.prompt_len for s in states], logits.shape[1],
                                        logits.device)
        with torch.inference_mode():  # the forward's logits are inference tensors
            sub = logits[rows]
            apply_penalties_(sub, counts, seen, penalties, [len(s.tokens) - s.prompt_len for s in states])
            logits[rows] = sub

    @staticmethod
    def _draw_on_host(inputs: list[ReqInput], states: list[ComputeState], logits: torch.Tensor,
                      grammar) -> list[int] | None:
        """``_sample_tokens``' tokens (the same coins) through ``sample_lists``, or None where it does not
        serve these logits."""
        if not cpu_sampler_serves(logits):
            return None
        return sample_lists(logits, *sampling_lists([inp.sampling for inp in inputs]), _coins(inputs, states), grammar)

    def _sample_tokens(self, inputs: list[ReqInput], states: list[ComputeState], logits: torch.Tensor,
                       grammar=None) -> list[int]:
        if all(inp.sampling.is_greedy for inp in inputs):  # no sampling tensors to build: one argmax
            return argmax_rows(logits).tolist()
        drawn = self._draw_on_host(inputs, states, logits, grammar)  # on the CPU: straight from the lists
        if drawn is not None:
            return drawn
        st = sampling_tensors([inp.sampling for inp in inputs], logits.device)
        uniforms = None if st.all_greedy else torch.tensor(_coins(inputs, states), device=logits.device)
        return sample(logits, st, uniforms).tolist()


def _penalties_now(inp: ReqInput, state: ComputeState):
    """The request's penalties where they change its next token's logits (or a later one's), else None: a
    min_new_tokens hold that is over leaves the request on the paths of unpenalised ones."""
    penalties = inp.sampling.penalties
    if penalties is None or not penalties.needed_from(len(state.tokens) - state.prompt_len):
        return None
    return penalties


def _coins(inputs: list[ReqInput], states: list[ComputeState]) -> list[float]:
    """Each request's coin for the token it samples now, at position len(tokens) of its sequence (0.0 when
    greedy)."""
    return [coin(inp.coin_key, len(state.tokens)) if inp.coin_key is not None else 0.0
            for inp, state in zip(inputs, states)]


def sampling_lists(params: list[SamplingParams]) -> tuple[list[float], list[int], list[float], list[float]]:
    """(temperatures, top_ks, top_ps, min_ps) of the requests, a greedy one's temperature 0."""
    return ([0.0 if sp.is_greedy else sp.temperature for sp in params], [sp.top_k for sp in params],
            [sp.top_p for sp in params], [sp.min_p for sp in params])


def sampling_tensors(params: list[SamplingParams], device) -> SamplingTensors:
    return SamplingTensors.from_lists(*sampling_lists(params), device=device)


def _catch_up(grammar: RequestGrammar, tokens: list[int]) -> bool:
    """Advance a forked matcher by the tokens the host had not taken when it forked; False when the
    request's grammar has ended (a token after its stop token is never offered to the matcher) or,
    impossibly for masked tokens, refuses one."""
    for token in tokens:
        if grammar.is_terminated() or not grammar.accept_token(token):
            return False
    return not grammar.is_terminated()
