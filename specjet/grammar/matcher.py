"""The grammar state of one request, and the token bitmask that carries it to the logits.

A bitmask is an int32 tensor [batch, ceil(vocab_size / 32)], one bit per token (1 = allowed),
filled on the CPU by `RequestGrammar.fill_next_token_bitmask` and applied to the logits by
`apply_token_bitmask_`.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Iterable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from specjet.grammar.forced_text import jump_forward_is_safe
from specjet.grammar.forced_tokens import ForcedTokens, restrict_row
from specjet.kernels import cpu_ops
from specjet.kernels.token_bitmask import allowed_counts


# Accepted tokens whose state's forced text a RequestGrammar remembers for a rollback (a draft tree's depth is far
# less); a deeper rollback searches again.
FORCED_TEXT_HISTORY = 64


class RequestGrammar:
    """One request's position in its grammar: which tokens may come next, and the tokens taken.

    Rollback is unlimited (xgrammar 0.2.8's Earley matcher keeps the whole history), which is
    what speculative decoding needs to undo a rejected draft.

    With ``forced`` (`forced_tokens`), every mask it gives allows only the forced token where the grammar
    forces text, so plain decoding and every verified draft write forced text in the tokenizer's tokens.

    The forced text is asked for at every state (each step's mask, each node of a draft tree), and xgrammar's
    search builds all of it each time: kilobytes of a long const or of a thousand required keys, rebuilt for
    every token written into it. So the text is remembered along the path: the grammar allows one byte at a
    time through forced text, so after a token that spells its beginning the forced text is the rest of it
    (the state the token reaches is the one the search passed through). A rollback restores what its state
    had; anything else (a token past the forced text, a fork's rollback, a reset) searches again.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, forced: ForcedTokens | None = None, *,
                 _matcher: xgr.GrammarMatcher | None = None, _stop_ids: tuple[int, ...] | None = None,
                 _forced_text: str | None = None):
        self.compiled = compiled
        self.forced = forced
        self._matcher = _matcher if _matcher is not None else xgr.GrammarMatcher(compiled)
        self._stop_ids = _stop_ids  # stop_token_ids(), once looked up
        self._forced_text = _forced_text  # find_jump_forward_string() at the current state; None: not known
        self._forced_before: deque[str | None] = deque(maxlen=FORCED_TEXT_HISTORY)  # ... before each accepted token

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        """Write the allowed next tokens into row `index` of `bitmask` (CPU int32).

        Returns False when every token is allowed, so the row need not be applied.
        """
        needs_applying = self._matcher.fill_next_token_bitmask(bitmask, index)
        if needs_applying:  # (a state allowing every token forces no text)
            self.restrict_to_forced(bitmask, index)
        return needs_applying

    def forced_token(self) -> int | None:
        """The token the forced-text rule writes next (None: the model chooses, or no rule): the first of the
        tokenizer's split of the forced text, which spells a prefix of it (``ForcedTokens`` checks), so the grammar
        takes it."""
        if self.forced is None or self._matcher.is_terminated():
            return None
        return self.forced.first_token(self.find_jump_forward_string())

    def restrict_to_forced(self, bitmask: torch.Tensor, index: int) -> None:
        """Row ``index`` of ``bitmask``, filled for this state, allows only the forced token where there is one."""
        token = self.forced_token()
        if token is not None:
            restrict_row(bitmask, index, token)

    def allows_a_token(self) -> bool:
        """Whether any token may come next: False where the grammar matches no text from here (a regex such as
        ``[^\x00-\U0010FFFF]`` compiles, then masks every logit). Allocates a bitmask: for an error path only."""
        vocab_size = self.compiled.tokenizer_info.vocab_size
        bitmask = allocate_token_bitmask(1, vocab_size)
        # bitmask_allows over the vocabulary's ids: the last word's bits past it are not tokens
        return not self.fill_next_token_bitmask(bitmask) or bool(bitmask_allows(bitmask, torch.arange(vocab_size)).any())

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it, or has ended (xgrammar
        would log a warning for every token offered after the stop token: drafts run past it routinely)."""
        matcher = self._matcher
        if matcher.is_terminated() or not matcher.accept_token(token_id):
            return False
        self._forced_text_after(token_id)
        return True

    def accept_tokens(self, token_ids: Iterable[int]) -> int:
        """Advance token by token; return how many were accepted before the first rejection (a token after
        the grammar's end is one)."""
        accepted = 0
        for token_id in token_ids:
            if not self.accept_token(int(token_id)):
                break
            accepted += 1
        return accepted

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens (the stop token included)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)
            history = self._forced_before
            if num_tokens > len(history):  # a state older than the history keeps: searched again when asked
                history.clear()
                self._forced_text = None
            else:
                for _ in range(num_tokens):
                    self._forced_text = history.pop()

    def _forced_text_after(self, token_id: int) -> None:
        """The forced text after accepting ``token_id``, where the text before it is known and the token spells a
        proper beginning of it (the rest is then forced: see the class's note); else not known."""
        before = self._forced_text
        self._forced_before.append(before)
        self._forced_text = None
        if before and self.forced is not None:
            text = self.forced.token_text(token_id)
            if text is not None and len(text) < len(before) and before.startswith(text):
                self._forced_text = before[len(text):]

    def fill_draft_tree_bitmask(
        self,
        next_token: torch.Tensor,
        next_sibling: torch.Tensor,
        tokens: torch.Tensor,
        bitmask: torch.Tensor,
    ) -> None:
        """Masks for every node of a draft tree in one walk (xgrammar's `traverse_draft_tree`).

        next_token / next_sibling / tokens: 1-D int64 CPU tensors of one tree (`TreeInfo`'s
        `retrive_next_token[b]`, `retrive_next_sibling[b]`, node-local, -1 = none); node 0 is the
        root, whose token this matcher has already accepted. Row i of `bitmask` ([N, W] int32)
        becomes the mask for the token after node i. What xgrammar 0.2.8 does beyond that
        (tests/test_spec_grammar.py pins it): a node whose token its parent's row forbids gets an
        all-zero row and its subtree is not visited, so those rows keep whatever they held; a
        node after the stop token gets an all-zero row; the matcher's state is unchanged.
        """
        self._matcher.traverse_draft_tree(next_token, next_sibling, tokens, bitmask)
        if self.forced is not None:
            self._restrict_tree(next_token.tolist(), next_sibling.tolist(), tokens.tolist(), bitmask)

    def _restrict_tree(self, next_token: list[int], next_sibling: list[int], tokens: list[int],
                       bitmask: torch.Tensor) -> None:
        """The forced-text rule on a filled tree's rows: each node reached through rows that allow its path (the
        rule's rows included) gets its state's restriction. A node that the rule's row of its parent now forbids,
        and its subtree, are not visited, as the walk leaves a forbidden node's (their rows are not read)."""
        words = bitmask.numpy().view(np.uint32)
        depth = 0  # tokens the matcher has taken on the walk's current path (rolled back at the end, whatever happens)
        stack = [(0, -1, 0)]  # (node, its parent, the depth its parent's state is at)
        try:
            while stack:
                node, parent, parent_depth = stack.pop()
                if node > 0:
                    if depth > parent_depth:
                        self.rollback(depth - parent_depth)
                        depth = parent_depth
                    token, row = tokens[node], words[parent]
                    if not ((token >> 5) < row.shape[0] and (int(row[token >> 5]) >> (token & 31)) & 1
                            and self.accept_token(token)):
                        continue
                    depth += 1
                self.restrict_to_forced(bitmask, node)
                children, child = [], next_token[node]
                while child >= 0:
                    children.append(child)
                    child = next_sibling[child]
                stack.extend((c, node, depth) for c in reversed(children))
        finally:
            if depth:
                self.rollback(depth)

    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end the grammar (the tokenizer's stop tokens), looked up once per request (forks get
        them: the scheduler forks a request's grammar every speculative iteration, and xgrammar builds its
        tokenizer-info object anew on every access)."""
        if self._stop_ids is None:
            self._stop_ids = tuple(self.compiled.tokenizer_info.stop_token_ids)
        return self._stop_ids

    def is_terminated(self) -> bool:
        """True once the stop token has been accepted."""
        return self._matcher.is_terminated()

    def find_jump_forward_string(self) -> str:
        """The longest string the grammar forces from here (state unchanged); "" for a grammar whose forced text
        was not shown to be bounded (`forced_text`): xgrammar's search has no length limit, and on a grammar
        whose forced text never ends it grows its string until memory runs out."""
        if self._forced_text is None:
            self._forced_text = self._matcher.find_jump_forward_string() if jump_forward_is_safe(self.compiled) else ""
        return self._forced_text

    def fork(self) -> RequestGrammar:
        """An independent copy of this state (e.g. to walk a draft branch without rollback)."""
        return RequestGrammar(self.compiled, self.forced, _matcher=self._matcher.fork(), _stop_ids=self.stop_token_ids(),
                              _forced_text=self._forced_text)

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._matcher.reset()
        self._forced_before.clear()
        self._forced_text = None


# One native call fills a whole batch's rows. Measured on the 2-core dev box (a JSON schema, 32
# matchers): 0.015 ms with one thread against 0.040 ms for a Python loop over the matchers, while two
# threads cost ~1.4 ms (thread start-up) and would take a core from the forward running beside it.
_BATCH_MATCHER = xgr.BatchGrammarMatcher(max_threads=1)


def fill_token_bitmasks(grammars: Sequence[RequestGrammar], bitmask: torch.Tensor, indices: Sequence[int]) -> None:
    """Row ``indices[i]`` of ``bitmask`` gets the allowed next tokens of ``grammars[i]``."""
    _BATCH_MATCHER.batch_fill_next_token_bitmask([g._matcher for g in grammars], bitmask, list(indices))
    for grammar, index in zip(grammars, indices):
        if grammar.forced is not None:
            grammar.restrict_to_forced(bitmask, index)


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask, int32 [batch_size, ceil(vocab_size / 32)], on the CPU."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


def empty_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """``allocate_token_bitmask``'s shape, not filled: for callers that fill every row they read (a decode
    step's rows of constrained requests; the other rows are never looked at), without the fill's cost."""
    return torch.empty(batch_size, (vocab_size + 31) // 32, dtype=torch.int32)


def bitmask_allows(bitmask: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Whether each row of `bitmask` allows each token: [R, W] int32 x [M] int64 -> [R, M] bool.

    The gather form (rather than unpacking whole rows) costs R x M, which matters when M is a
    draft head's few thousand hot tokens rather than the whole vocabulary. On the CPU, numpy unpacks
    whole rows (bit t of the little-endian words is token t) and gathers: a few torch ops over M
    int64 lanes cost several times more at a drafter's one row per position.
    """
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        return torch.from_numpy(_unpacked_bits(bitmask)[:, token_ids.cpu().numpy()].view(bool))
    token_ids = token_ids.to(device=bitmask.device, dtype=torch.int64)
    words = bitmask[:, token_ids >> 5].to(torch.int64)  # [R, M]
    return ((words >> (token_ids & 31)) & 1).bool()


def bitmask_popcount(bitmask: torch.Tensor) -> torch.Tensor:
    """Allowed tokens per row of `bitmask` (its set bits): [R, W] int32 -> [R] int64."""
    if bitmask.device.type == "cpu":
        return allowed_counts(bitmask)
    words = bitmask.to(torch.int64) & 0xFFFFFFFF
    return ((words[:, :, None] >> torch.arange(32, device=bitmask.device)) & 1).sum(dim=(1, 2))


def _unpacked_bits(bitmask: torch.Tensor) -> np.ndarray:
    """A CPU bitmask [R, W] int32 as [R, 32 W] uint8 0/1, column t for token t (little-endian words)."""
    return np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, bitorder="little")


def apply_token_bitmask_(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Sequence[int] | None = None
) -> None:
    """Set forbidden logits to -inf, in place. logits: [B, V] float; bitmask: [B, ceil(V / 32)].

    With `indices`, only those rows are masked and every other row is left untouched (requests
    without a grammar); without, every row is masked (an all-ones row masks nothing).
    """
    if indices is not None:
        indices = list(indices)
        if not indices:
            return
    ext = cpu_ops.extension()
    if (ext is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and bitmask.device.type == "cpu"):
        # xgrammar's CPU kernel's result (the columns past 32 W left alone) a word of the mask at a time: that
        # kernel tests every bit, which a sampled constrained verify paid on every node's row.
        rows = range(logits.shape[0]) if indices is None else sorted(set(indices))
        ext.apply_token_bitmask_rows(logits, bitmask, [int(r) for r in rows])
        return
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)
