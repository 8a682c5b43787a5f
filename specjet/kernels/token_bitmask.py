"""Token bitmasks (xgrammar's layout: int32 [R, ceil(V / 32)], token t = bit t % 32 of word t // 32) counted on
the host. grammar/matcher.py's ``bitmask_popcount`` and kernels/argmax_bound.py both read it."""
from __future__ import annotations

import sys

import numpy as np
import torch


def allowed_counts(bitmask: torch.Tensor) -> torch.Tensor:
    """int64 [R]: the set bits of each row of a CPU int32 [R, W] bitmask."""
    words = bitmask.contiguous().numpy()
    if hasattr(np, "bitwise_count"):  # numpy >= 2: one pass over the words
        return torch.from_numpy(np.bitwise_count(words.view(np.uint32)).sum(-1, dtype=np.int64))
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder=sys.byteorder)
    return torch.from_numpy(bits.sum(-1, dtype=np.int64))


__all__ = ["allowed_counts"]
