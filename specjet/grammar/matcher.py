"""The grammar state of one request, and the token bitmask that carries it to the logits.

A bitmask is an int32 tensor [batch, ceil(vocab_size / 32)], one bit per token (1 = allowed),
filled on the CPU by `RequestGrammar.fill_next_token_bitmask` and applied to the logits by
`apply_token_bitmask_`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import xgrammar as xgr


class RequestGrammar:
    """One request's position in its grammar: which tokens may come next, and the tokens taken.

    Rollback is unlimited (xgrammar 0.2.8's Earley matcher keeps the whole history), which is
    what speculative decoding needs to undo a rejected draft.
    """

    def __init__(self, compiled: xgr.CompiledGrammar, *, _matcher: xgr.GrammarMatcher | None = None):
        self.compiled = compiled
        self._matcher = _matcher if _matcher is not None else xgr.GrammarMatcher(compiled)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        """Write the allowed next tokens into row `index` of `bitmask` (CPU int32).

        Returns False when every token is allowed, so the row need not be applied.
        """
        return self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""
        return self._matcher.accept_token(token_id)

    def accept_tokens(self, token_ids: Iterable[int]) -> int:
        """Advance token by token; return how many were accepted before the first rejection."""
        accepted = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(int(token_id)):
                break
            accepted += 1
        return accepted

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens (the stop token included)."""
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True once the stop token has been accepted."""
        return self._matcher.is_terminated()

    def find_jump_forward_string(self) -> str:
        """The longest string the grammar forces from here (state unchanged)."""
        return self._matcher.find_jump_forward_string()

    def fork(self) -> RequestGrammar:
        """An independent copy of this state (e.g. to walk a draft branch without rollback)."""
        return RequestGrammar(self.compiled, _matcher=self._matcher.fork())

    def reset(self) -> None:
        """Back to the start of the grammar."""
        self._matcher.reset()


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask, int32 [batch_size, ceil(vocab_size / 32)], on the CPU."""
    return xgr.allocate_token_bitmask(batch_size, vocab_size)


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
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=indices)
