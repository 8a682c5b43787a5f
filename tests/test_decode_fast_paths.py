"""A decode step's fast paths give what the general ones give: its attention metadata
(``ForwardBatch.decode`` against ``ForwardBatch.build``) and the RoPE table (``Rotary.cos_sin``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specjet.kernels.cpu_ops import native_attention_args
from specjet.models.config import ModelConfig
from specjet.models.forward_batch import ForwardBatch, ForwardMode
from specjet.models.llama import Rotary


def _table(rows: int = 6, width: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randperm(rows * width, generator=gen).view(rows, width) + 10


@pytest.mark.parametrize("lengths", [[7], [5, 5, 5], [9, 3, 12], [1, 30]])
def test_decode_batch_equals_the_general_build(lengths):
    table = _table()
    rows = torch.tensor([4, 1, 5, 0][:len(lengths)])
    positions = torch.tensor(lengths) - 1
    ids = torch.arange(len(lengths)) + 100
    fast = ForwardBatch.decode(ids, positions, table, rows, list(lengths))
    ref = ForwardBatch.build(ForwardMode.DECODE, input_ids=ids, positions=positions, out_cache_loc=table[rows, positions],
                             req_to_token=table, req_pool_indices=rows, kv_lens=positions + 1,
                             q_lens=torch.ones_like(positions), logits="all")
    assert fast.mode is ref.mode and fast.logits_indices is None and ref.logits_indices is None
    assert torch.equal(fast.out_cache_loc, ref.out_cache_loc)
    for field in dataclasses.fields(ref.attn):
        a, b = getattr(fast.attn, field.name), getattr(ref.attn, field.name)
        if field.name == "mask_inputs":
            continue  # compared through the mask they build
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        else:
            assert a == b, field.name
    # The padded rows' mask (the torch paths) and the C++ kernel's arguments.
    assert (fast.attn.mask is None) == (ref.attn.mask is None)
    if ref.attn.mask is not None:
        assert torch.equal(fast.attn.mask, ref.attn.mask)
    for a, b in zip(native_attention_args(fast.attn), native_attention_args(ref.attn)):
        assert (a is None and b is None) or torch.equal(a, b)


def _rotary() -> Rotary:
    from transformers import LlamaConfig

    return Rotary(ModelConfig.from_hf(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_do_not_change_as_it_grows(dtype):
    rotary = _rotary()
    early = torch.tensor([0, 5, 1023, 17])
    cos0, sin0 = rotary.cos_sin(early, dtype)
    assert rotary._tables[dtype][0].shape[0] == Rotary.TABLE_BLOCK
    late = torch.tensor([3000, 5, 1024, 0, 1023])
    cos1, sin1 = rotary.cos_sin(late, dtype)  # past the table: it grows to 3 blocks
    assert rotary._tables[dtype][0].shape[0] == 3 * Rotary.TABLE_BLOCK
    assert torch.equal(cos1[[3, 1, 4]], cos0[[0, 1, 2]]) and torch.equal(sin1[[3, 1, 4]], sin0[[0, 1, 2]])
    # The table holds what the direct computation gives (to a rounding: the two may vectorise differently).
    direct_cos, direct_sin = rotary._compute(late, dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(cos1, direct_cos, atol=tol, rtol=0)
    torch.testing.assert_close(sin1, direct_sin, atol=tol, rtol=0)
    assert cos1.shape == (5, 16) and cos1.dtype == dtype
    empty_cos, _ = rotary.cos_sin(torch.zeros(0, dtype=torch.int64), dtype)
    assert empty_cos.shape == (0, 16)


def test_rope_table_grown_in_inference_mode_serves_training():
    """A table first grown under inference_mode (an engine's forward) is read by a training forward
    (a trainer evaluating, then training, one draft): the gradient flows to the rotated input."""
    from specjet.models.llama import apply_rotary

    rotary = _rotary()
    with torch.inference_mode():
        rotary.cos_sin(torch.arange(4), torch.float32)
    x = torch.randn(4, 2, 32, requires_grad=True)
    cos, sin = rotary.cos_sin(torch.arange(4), torch.float32)
    apply_rotary(x, cos, sin).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
