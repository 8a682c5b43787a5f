"""N-gram drafting: no model, no training.

Drafts come from matching the last tokens of a request (its prompt and output so far) against
earlier places in the same sequence: what followed those earlier occurrences is proposed as the
continuation. Several matches branch into a tree (a trie of continuations), so the verifier can
accept whichever one the target agrees with. Good on JSON (keys and punctuation repeat) and on
tasks that copy from the prompt.

``NgramIndex`` is the per-request suffix index: for every n-gram length 1..max_window it maps the
n-gram to the positions where it ends, updated incrementally as tokens are accepted.
A request's predicted output (prediction.py) gives a branch of its tree wherever the reply's last
tokens match it, ahead of the request's own continuations.
"""
from __future__ import annotations

from typing import Callable

import torch

from specjet.spec_v2.config import NgramConfig
from specjet.spec_v2.drafter import DraftRequest, DraftTree, SpecInput
from specjet.spec_v2.prediction import PredictionIndex, PredictionText, TokenText
from specjet.spec_v2.tree_verifier import VerifyResult


class NgramIndex:
    def __init__(self, max_window: int):
        self.max_window = max_window
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for tok in tokens:
            self.tokens.append(tok)
            t = len(self.tokens) - 1
            for w in range(1, min(self.max_window, t + 1) + 1):
                key = tuple(self.tokens[t - w + 1: t + 1])
                self._ends.setdefault(key, []).append(t)

    def ends_of(self, ngram: list[int]) -> list[int]:
        """The positions where ``ngram`` ends in the tokens, ascending."""
        return self._ends.get(tuple(ngram), [])

    def continuations(self, cfg: NgramConfig, max_len: int, after: list[int] = ()) -> list[list[int]]:
        """Up to ``cfg.max_branches`` distinct continuations of the current suffix, best first:
        longer matched windows first, then more recent occurrences. ``after``: tokens taken as
        already following the sequence (a grammar's forced chain): the suffix matched ends with
        them, and continuations are of the extended sequence."""
        after = list(after)
        n = len(self.tokens)
        seq_len = n + len(after)
        tail = self.tokens[-cfg.max_window:] + after
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for w in range(min(cfg.max_window, seq_len - 1), cfg.min_window - 1, -1):
            ends = self._ends.get(tuple(tail[len(tail) - w:]), ())
            scanned = 0
            for end in reversed(ends):
                if end >= seq_len - 1:  # the suffix itself
                    continue
                scanned += 1
                if scanned > cfg.max_matches_scanned:
                    break
                cont = self.tokens[end + 1: end + 1 + max_len]
                key = tuple(cont)
                if cont and key not in seen:
                    seen.add(key)
                    found.append(cont)
                    if len(found) >= cfg.max_branches:
                        return found
        return found


def build_trie(root_token: int, continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge continuations into a tree with at most ``max_nodes`` nodes (root included).

    Returns (tokens, parents) with the root at index 0 (parent -1), every parent before its
    children, and children in the order their continuations were given (best first)."""
    tokens, parents = [root_token], [-1]
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        node = 0
        for tok in cont:
            nxt = children.get((node, tok))
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                children[(node, tok)] = nxt
            node = nxt
    return tokens, parents  # creation order: parents before children, siblings best first


class NgramDrafter:
    """Proposes a draft tree per request from its own n-gram index (a ``Drafter``)."""

    feature_capture = None  # it reads tokens only
    draft_kv_reads_next_token = False  # it keeps no KV

    def __init__(self, cfg: NgramConfig):
        self.cfg = cfg
        self._indexes: dict[str, NgramIndex] = {}
        self._predictions: dict[str, PredictionIndex | PredictionText] = {}
        # What a prediction given as text needs of the tokenizer (set by the speculator; None: such
        # predictions are not drafted from).
        self.token_text: TokenText | None = None

    def scratch_slots(self, batch_size: int) -> int:
        return 0

    def after_prefill(self, reqs: list[SpecInput], hidden: torch.Tensor | None, first_tokens: list[int],
                      req_to_token: torch.Tensor) -> None:
        pass  # the index is brought up to date when the request drafts

    def propose(self, reqs: list[DraftRequest], share: int, req_to_token: torch.Tensor) -> list[DraftTree]:
        trees = []
        for r in reqs:
            self.observe(r.input.rid, r.input.token_ids)
            if r.input.prediction and r.input.rid not in self._predictions:
                self._add_prediction(r.input)
            legal_len = r.guide.legal_prefix_len if r.guide is not None else None
            trees.append(self.tree_for(r.input.rid, r.budget, r.chain, legal_len))
        return trees

    def after_verify(self, reqs: list[SpecInput], result: VerifyResult, req_to_token: torch.Tensor) -> None:
        pass  # the accepted tokens reach the index with the request's next token_ids

    def _add_prediction(self, req: SpecInput) -> None:
        """Token ids are matched as tokens (the model's own split, e.g. an earlier reply's output ids); text
        as bytes, so a reply that spells it in other pieces than the tokenizer's still finds its place."""
        if not isinstance(req.prediction, str):
            index = NgramIndex(self.cfg.max_window)
            index.extend(req.prediction)
            self._predictions[req.rid] = PredictionIndex(index)
        elif self.token_text is not None:
            self._predictions[req.rid] = PredictionText(req.prediction, req.prompt_len, self.token_text)

    def observe(self, rid: str, all_tokens: list[int]) -> None:
        """Bring the request's index up to date with its full token list (prompt + output)."""
        index = self._indexes.get(rid)
        if index is None or len(index.tokens) > len(all_tokens):
            index = self._indexes[rid] = NgramIndex(self.cfg.max_window)
        index.extend(all_tokens[len(index.tokens):])

    def tree_for(self, rid: str, max_nodes: int, chain: list[int] = (),
                 legal_len: Callable[[list[int], list[int]], int] | None = None) -> DraftTree:
        """A trie of continuations under the last token. Grammar-aware drafting passes ``chain``
        (the grammar's forced tokens: a sure branch, and the place continuations are matched from)
        and ``legal_len`` (``legal_len(prefix, tokens)``: how many of ``tokens`` the grammar
        accepts after ``prefix``): each continuation is cut at its first illegal token, so the
        node budget goes to tokens verification can accept.

        The forced *text* is certain but the chain is only the tokenizer's split of it, and a
        constrained model often spells differently ('a', 'rg', 'um', 'en', 't', 's' where the
        tokenizer says 'a', 'rguments'). So a legal continuation matched from the sequence itself
        that leaves the chain within the chain's length goes first: once the request has written
        that text before, its own spelling is the better guess. The chain's branch follows. (Under the
        forced-text rule, grammar/forced_tokens.py, ``legal_len`` cuts a branch where it leaves the rule's
        tokens, so no other spelling is drafted: the model writes the tokenizer's.)

        A request's predicted output, where its last tokens (and the chain) match it, gives the first
        branch after those: the caller's own guess at the reply."""
        index = self._indexes[rid]
        chain = list(chain)[: max(0, max_nodes - 1)]
        respelled = []
        if chain:
            respelled = index.continuations(self.cfg, max_len=max_nodes - 1)
            if legal_len is not None:
                respelled = [cont[: legal_len([], cont)] for cont in respelled]
            respelled = [cont for cont in respelled if cont and cont[: len(chain)] != chain[: len(cont)]]
        room = max_nodes - 1 - len(chain)
        conts = index.continuations(self.cfg, max_len=room, after=chain) if room > 0 else []
        if legal_len is not None:
            conts = [cont[: legal_len(chain, cont)] for cont in conts]
        branches = respelled + [chain + cont for cont in conts]
        prediction = self._predictions.get(rid)
        if prediction is not None and room > 0:
            cont = prediction.continuation(self.cfg, index.tokens, chain, room)
            if legal_len is not None:
                cont = cont[: legal_len(chain, cont)]
            if cont:  # after the request's own spelling of the forced text (the chain's is the tokenizer's)
                branches.insert(len(respelled), chain + cont)
        return build_trie(index.tokens[-1], branches[: self.cfg.max_branches] + [chain], max_nodes)

    def release(self, rid: str) -> None:
        self._indexes.pop(rid, None)
        self._predictions.pop(rid, None)
