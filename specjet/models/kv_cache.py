"""KV buffers: per layer, K and V indexed by slot. Slot indices come from the scheduler's allocator.

Slot 0 (the first page) is never handed out: padded positions of a batch point at it, so a write
or read through padding touches memory no request owns.

Every user sees ``k`` and ``v`` as [layers, slots, H_kv, D]. On the CPU that is a view of head-major
memory ([layers, H_kv, slots, D]): a KV head's keys lie side by side in slot order, so the attention
reads a request's (mostly consecutive) slots as one stream instead of one row every H_kv rows; the C++
kernels take either layout by its strides (kernels never index the memory any other way). On CUDA the
pool stays slot-major, the layout its Triton kernels were written and measured for.

On the CPU the pool lies in its own anonymous memory map, whose pages the OS hands out zeroed when they are first
written: a pool sized for the whole token budget takes memory as far as requests have filled it (``torch.zeros``
would write, and so keep resident, every page up front).
"""
from __future__ import annotations

import math
import mmap

import torch


def zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU zero tensor whose pages become resident as they are written (an anonymous private map, page-aligned;
    the tensor keeps the map alive). ``torch.zeros`` where the platform has no such map."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype, device):
        if torch.device(device).type == "cpu":
            shape = (num_layers, num_kv_heads, num_slots, head_dim)
            self.k = zeroed_cpu(shape, dtype).transpose(1, 2)
            self.v = zeroed_cpu(shape, dtype).transpose(1, 2)
        else:
            shape = (num_layers, num_slots, num_kv_heads, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))  # a bf16 cache beside float32 rows rounds them
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from slots ``src`` to ``dst`` (used to compact accepted tree nodes)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
