"""``argmax_rows``: ``torch.argmax(logits, -1)`` of a 2-D float32 CPU tensor, the same ids, in one vectorised
C++ pass a row.

torch's CPU argmax is a generic reduction that carries an index through every column; a greedy step reads the
whole vocabulary's logits of every row it decodes or verifies, and there that reduction costs several times
what a pass over 64-column block maxima does (csrc/draft_ops.cpp, which then visits only the blocks that may
hold the answer). The rule is torch's: the first maximal value, the first NaN where a row holds one.
"""
from __future__ import annotations

import torch

from specjet.kernels import cpu_ops


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [R]: each row's ``torch.argmax`` of ``logits`` [R, V]; the C++ pass where it serves (the extension
    built, a CPU float32 tensor), torch's argmax otherwise."""
    ext = cpu_ops.extension()
    if (ext is not None and logits.dim() == 2 and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.shape[1] > 0 and not logits.requires_grad):
        return ext.argmax_rows(logits)
    return logits.argmax(-1)
