"""A constrained request's grammar as speculation uses it within one decode iteration.

Three uses, each leaving the grammar's state exactly as it found it (every accept is rolled back),
because the scheduler advances the matcher later, by the accepted tokens only:

- verification (always): per-node masks of the draft tree, and the tree without its illegal
  nodes (`mask_tree`);
- grammar-aware drafting: the mask after any draft path (`masks_after`), so a drafter spends no
  tree slot on a token the grammar forbids, and the legal prefix of an n-gram continuation;
- jump-forward folded into speculation: the tokens of the text the grammar forces next
  (`forced_chain`). They enter the tree as a chain under the root with probability 1; the target
  still verifies them, so a tokenization it would not have chosen is only a rejected branch.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from specjet.grammar import RequestGrammar, empty_token_bitmask, mask_draft_tree


# Characters of forced text tokenized per token wanted: more than almost any token spells.
_FORCED_CHARS_PER_TOKEN = 32


class GrammarGuide:
    def __init__(self, grammar: RequestGrammar, vocab_size: int,
                 tokenize: Callable[[str], list[int]] | None = None):
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.tokenize = tokenize  # text -> token ids as the model's tokenizer splits it; None: no chains

    # ------------------------------------------------------------------ jump-forward
    def forced_chain(self, max_len: int) -> list[int]:
        """Tokens of the grammar's forced continuation from its current state, at most `max_len`,
        each accepted in turn ([] after the grammar's end; after a draft chain: ``ChainWalk``).

        The last token of the forced text's tokenization is left out unless the grammar can only
        stop after it: at the text's end the model may merge it with what follows (' "' then
        'web' versus ' "web'), and the drafter, which sees the grammar mask there, proposes that
        boundary token better than a tokenizer that cannot see past the forced text. Under the
        forced-text rule (``grammar.forced``) the chain is the tokens the rule writes, which leaves
        the boundary token to the model likewise."""
        if max_len <= 0 or self.grammar.is_terminated():
            return []
        if self.grammar.forced is not None:  # the tokens the forced-text rule writes: the target takes them all
            return self._rule_chain(max_len)
        if self.tokenize is None:
            return []
        text = self.grammar.find_jump_forward_string()
        if not text:
            return []
        # At most max_len tokens are used: a forced text of kilobytes (a long const, a counted repeat) is
        # tokenized only as far as they can reach (a cut text's last token is dropped below, as at any end).
        ids = self.tokenize(text[:_FORCED_CHARS_PER_TOKEN * (max_len + 1)])
        accepted = self.grammar.accept_tokens(ids)
        try:
            keep = accepted if accepted < len(ids) or self._only_stop_allowed() else len(ids) - 1
        finally:
            self.grammar.rollback(accepted)
        return ids[:min(keep, max_len)]

    def _rule_chain(self, max_len: int) -> list[int]:
        ids: list[int] = []
        try:
            while len(ids) < max_len and (token := self.grammar.forced_token()) is not None:
                if not self.grammar.accept_token(token):  # (its one accept: the rule's token is the grammar's)
                    break
                ids.append(token)
        finally:
            self.grammar.rollback(len(ids))
        return ids

    def _only_stop_allowed(self) -> bool:
        """Whether the grammar allows no token here but its stop tokens (or none at all)."""
        if self.grammar.is_terminated():
            return True
        bitmask = empty_token_bitmask(1, self.vocab_size)  # the fill writes every word
        self.grammar.fill_next_token_bitmask(bitmask, 0)
        words = bitmask.numpy().view(np.uint32)[0]
        for t in self.grammar.stop_token_ids():
            if 0 <= t < 32 * words.shape[0]:
                words[t >> 5] &= ~np.uint32(1 << (t & 31))
        return not words.any()

    # ------------------------------------------------------------------ drafting
    def masks_after(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), W] int32: the tokens allowed after each path from the root (an illegal
        path, or one through the stop token, gets an all-zero row: nothing may follow it)."""
        bitmask = empty_token_bitmask(len(paths), self.vocab_size)  # every row filled or zeroed below
        for i, path in enumerate(paths):
            taken = self.grammar.accept_tokens(path)
            if taken == len(path) and not self.grammar.is_terminated():
                self.grammar.fill_next_token_bitmask(bitmask, i)
            else:
                bitmask[i] = 0
            self.grammar.rollback(taken)
        return bitmask

    def walk(self, path: Sequence[int] = ()) -> "ChainWalk":
        """The grammar along a chain that grows one token at a time from ``path`` (a ``with`` block:
        its accepts are rolled back at the end)."""
        return ChainWalk(self, path)

    def legal_prefix_len(self, prefix: list[int], tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts after `prefix` (itself assumed legal), under the forced-text
        rule where the grammar has it (a token other than the one it forces is not accepted: its node would be
        pruned at verification, and an n-gram branch spelling forced text the request's old way is cut there)."""
        grammar = self.grammar
        taken = grammar.accept_tokens(prefix)
        try:
            if taken < len(prefix):
                return 0
            more = 0
            for token in tokens:
                forced = grammar.forced_token() if grammar.forced is not None else None
                if (forced is not None and forced != token) or not grammar.accept_token(token):
                    break
                more += 1
                taken += 1
            return more
        finally:
            grammar.rollback(taken)

    # ------------------------------------------------------------------ verification
    def mask_tree(self, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int], torch.Tensor]:
        """The tree without its illegal nodes (and their subtrees), and the grammar mask after
        each kept node: (tokens, parents, bitmask [kept, W]). Kept nodes keep their order, so
        parents still come before children and siblings keep their draft order."""
        masks = mask_draft_tree(self.grammar, tokens, parents, self.vocab_size)
        keep = [i for i, ok in enumerate(masks.legal) if ok]
        if len(keep) == len(tokens):
            return tokens, parents, masks.bitmask
        new_index = {old: new for new, old in enumerate(keep)}
        kept_parents = [-1] + [new_index[parents[i]] for i in keep[1:]]
        return [tokens[i] for i in keep], kept_parents, masks.bitmask[keep]



class ChainWalk:
    """Grammar-aware drafting's left-to-right walk along a chain: each token is accepted once, as the
    chain grows (``masks_after`` of every prefix would accept the chain from the root again at every
    step), and all of them are rolled back when the ``with`` block ends. Its masks and forced text are
    those of a matcher that took the chain."""

    def __init__(self, guide: GrammarGuide, path: Sequence[int]):
        self.guide = guide
        self.grammar = guide.grammar
        self.path = list(path)
        self.taken = 0
        self.legal = True  # every token of the chain so far was accepted
        self.bitmask = empty_token_bitmask(1, guide.vocab_size)  # one buffer, filled or zeroed by mask()

    def __enter__(self) -> "ChainWalk":
        self.taken = self.grammar.accept_tokens(self.path)
        self.legal = self.taken == len(self.path)
        return self

    def __exit__(self, *exc) -> None:
        self.grammar.rollback(self.taken)
        self.taken = 0

    def mask(self) -> torch.Tensor:
        """[1, W] int32: the tokens allowed after the chain (all-zero after an illegal token or the
        grammar's end). The buffer is the walk's own: the next call overwrites it."""
        if self.legal and not self.grammar.is_terminated():
            self.grammar.fill_next_token_bitmask(self.bitmask, 0)
        else:
            self.bitmask.zero_()
        return self.bitmask

    def take(self, token: int) -> None:
        """Grow the chain by ``token``."""
        if self.legal:
            accepted = self.grammar.accept_tokens([token])
            self.taken += accepted
            self.legal = accepted == 1

    def forced_chain(self, max_len: int) -> list[int]:
        """The grammar's forced text after the chain (``GrammarGuide.forced_chain``)."""
        return self.guide.forced_chain(max_len) if self.legal else []
