"""A decode step's and a verify's fast paths give what the general ones give: the attention metadata
from host lengths (``ForwardBatch.from_host`` against ``ForwardBatch.build``) and the RoPE table
(``Rotary.cos_sin``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specjet.kernels.cpu_ops import native_attention_args
from specjet.models.config import ModelConfig
from specjet.models.forward_batch import ForwardBatch, ForwardMode, host_token_tensors
from specjet.models.llama import Rotary


def _table(rows: int = 6, width: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randperm(rows * width, generator=gen).view(rows, width) + 10


def _assert_same_metadata(fast, ref):
    for field in dataclasses.fields(ref):
        if field.name in ("mask_inputs", "mask_tensor"):
            continue  # compared through the mask they build
        a, b = getattr(fast, field.name), getattr(ref, field.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), field.name
        else:
            assert a == b, field.name
    # The torch paths' mask and the C++ kernel's arguments.
    assert (fast.mask is None) == (ref.mask is None)
    if ref.mask is not None:
        assert torch.equal(fast.mask, ref.mask)
    for a, b in zip(native_attention_args(fast), native_attention_args(ref)):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("lengths", [[7], [5, 5, 5], [9, 3, 12], [1, 30]])
def test_decode_batch_from_host_lengths_equals_the_general_build(lengths):
    table = _table()
    rows = torch.tensor([4, 1, 5, 0][:len(lengths)])
    positions = torch.tensor(lengths) - 1
    ids = torch.arange(len(lengths)) + 100
    slots = table[rows, positions]
    fast = ForwardBatch.from_host(ForwardMode.DECODE, ids, positions, slots, table, rows.tolist(), [1] * len(lengths),
                                  list(lengths))
    ref = ForwardBatch.build(ForwardMode.DECODE, input_ids=ids, positions=positions, out_cache_loc=slots,
                             req_to_token=table, req_pool_indices=rows, kv_lens=positions + 1,
                             q_lens=torch.ones_like(positions), logits="all")
    assert fast.mode is ref.mode and fast.logits_indices is None and ref.logits_indices is None
    _assert_same_metadata(fast.attn, ref.attn)


@pytest.mark.parametrize("q_lens, kv_lens", [([4], [20]), ([3, 1, 5], [10, 7, 40]), ([2, 2], [9, 9]),
                                             ([1, 6], [30, 30])])
def test_verify_batch_from_host_lengths_equals_the_general_build(q_lens, kv_lens):
    """Trees of several nodes under a custom mask (and one without), rows of different lengths, and
    the pieces ``select`` cuts out of the metadata (the torch paths' length groups)."""
    table = _table()
    gen = torch.Generator().manual_seed(len(q_lens))
    rows = torch.tensor([2, 5, 0][:len(q_lens)])
    max_q, total = max(q_lens), sum(q_lens)
    mask = torch.rand(len(q_lens), max_q, max_q, generator=gen) < 0.5
    mask |= torch.eye(max_q, dtype=torch.bool)
    ids, positions = torch.arange(total) + 7, torch.arange(total)
    slots = torch.arange(total) + 300
    for custom in (mask, None):
        fast = ForwardBatch.from_host(ForwardMode.VERIFY, ids, positions, slots, table, rows.tolist(), q_lens, kv_lens,
                                      custom)
        ref = ForwardBatch.build(ForwardMode.VERIFY, input_ids=ids, positions=positions, out_cache_loc=slots,
                                 req_to_token=table, req_pool_indices=rows, kv_lens=torch.tensor(kv_lens),
                                 q_lens=torch.tensor(q_lens), custom_mask=custom, logits="all")
        _assert_same_metadata(fast.attn, ref.attn)
        for pick in ([0], list(range(len(q_lens)))[::-1]):
            picked = torch.tensor(pick)
            fresh_fast = ForwardBatch.from_host(ForwardMode.VERIFY, ids, positions, slots, table, rows.tolist(), q_lens,
                                                kv_lens, custom).attn.select(picked)
            fresh_ref = ForwardBatch.build(ForwardMode.VERIFY, input_ids=ids, positions=positions, out_cache_loc=slots,
                                           req_to_token=table, req_pool_indices=rows, kv_lens=torch.tensor(kv_lens),
                                           q_lens=torch.tensor(q_lens), custom_mask=custom,
                                           logits="all").attn.select(picked)
            _assert_same_metadata(fresh_fast, fresh_ref)


@pytest.mark.parametrize("q_lens, kv_lens", [([3], [12]), ([2, 3, 1], [10, 7, 40]), ([4, 4], [9, 20])])
def test_extend_batch_from_host_lengths_equals_the_general_build(q_lens, kv_lens):
    """A draft extend's batch (causal new positions, logits of each request's last one) from host lists."""
    table = _table()
    rows = torch.tensor([3, 0, 5][:len(q_lens)])
    total = sum(q_lens)
    ids, positions, slots = torch.arange(total) + 9, torch.arange(total), torch.arange(total) + 200
    fast = ForwardBatch.from_host(ForwardMode.EXTEND, ids, positions, slots, table, rows.tolist(), q_lens, kv_lens,
                                  last_logits=True)
    ref = ForwardBatch.build(ForwardMode.EXTEND, input_ids=ids, positions=positions, out_cache_loc=slots,
                             req_to_token=table, req_pool_indices=rows, kv_lens=torch.tensor(kv_lens),
                             q_lens=torch.tensor(q_lens), logits="last")
    assert fast.logits_indices.dtype == ref.logits_indices.dtype and torch.equal(fast.logits_indices, ref.logits_indices)
    _assert_same_metadata(fast.attn, ref.attn)


def test_host_token_tensors_read_the_table_and_leave_it_alone():
    """The decode step's ids / positions / slots from host lists == the torch gather they replace; the
    metadata's KV rows are a copy (the padding written into them never reaches the table) and its cached
    range layout is shared read-only, outside inference mode too."""
    table = _table()
    before = table.clone()
    rows, cols = [4, 1, 4], [3, 0, 9]
    ids, positions, slots = host_token_tensors(table, [11, 12, 13], [7, 8, 9], rows, cols)
    assert ids.tolist() == [11, 12, 13] and positions.tolist() == [7, 8, 9]
    assert slots.dtype == torch.int64 and torch.equal(slots, table[torch.tensor(rows), torch.tensor(cols)])
    with torch.inference_mode():
        meta = ForwardBatch.from_host(ForwardMode.DECODE, ids, positions, slots, table, [4, 1], [1, 1], [5, 9]).attn
    assert meta.kv_indices[0, 5:].eq(0).all()  # the shorter row's padding...
    assert torch.equal(table, before)  # ...written into a copy
    single = ForwardBatch.from_host(ForwardMode.DECODE, ids[:1], positions[:1], slots[:1], table, [4], [1], [5]).attn
    assert not single.q_gather.is_inference() and single.q_gather.tolist() == [[0]]
    single.kv_indices.fill_(-1)
    assert torch.equal(table, before)


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
