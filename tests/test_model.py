"""The Llama-family model against Hugging Face transformers on tiny random-weight models."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_model_dir
from model_harness import OneRequest, load_runner
from specjet.models.forward_batch import ForwardMode


def hf_logits(model_dir, ids, output_hidden_states=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=output_hidden_states)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def family_dir(request, tmp_path_factory, default_model_dir):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), default_model_dir, request.param,
                               tie=request.param != "qwen2")


IDS = [1, 520, 3303, 28, 2185, 16, 4785, 1024, 88, 9, 701, 45, 6000, 13, 300, 2]


def test_prefill_logits_match_hf(family_dir):
    runner = load_runner(family_dir)
    ours = OneRequest(runner).extend(IDS).logits
    ref = hf_logits(family_dir, IDS).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


def test_chunked_prefill_and_decode_match_one_shot(family_dir):
    runner = load_runner(family_dir)
    full = OneRequest(runner).extend(IDS).logits
    req = OneRequest(runner)
    part1 = req.extend(IDS[:5]).logits  # prefill
    part2 = req.extend(IDS[5:11]).logits  # extend after a cached prefix
    steps = [req.extend([t], mode=ForwardMode.DECODE).logits for t in IDS[11:]]  # decode
    torch.testing.assert_close(torch.cat([part1, part2, *steps]), full, atol=1e-4, rtol=1e-4)


def test_verify_with_tree_mask_matches_each_branch(family_dir):
    """Two branches after a shared prefix, verified in one forward under a tree mask, give the same
    logits as running each branch as a plain sequence."""
    runner = load_runner(family_dir)
    prefix, a, b = IDS[:6], [700, 701], [900]
    # nodes: 0=a0, 1=a1 (child of a0), 2=b0 (sibling of a0)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)[None]
    req = OneRequest(runner)
    req.extend(prefix)
    n = len(prefix)
    from specjet.models.forward_batch import ForwardBatch

    batch = ForwardBatch.build(
        ForwardMode.VERIFY,
        input_ids=torch.tensor(a + b),
        positions=torch.tensor([n, n + 1, n]),
        out_cache_loc=req.table[0, n:n + 3],
        req_to_token=req.table,
        req_pool_indices=torch.tensor([0]),
        kv_lens=torch.tensor([n + 3]),
        q_lens=torch.tensor([3]),
        custom_mask=mask,
        logits="all",
    )
    tree = runner.forward(batch).logits
    ref_a = hf_logits(family_dir, prefix + a).logits[0, n:]
    ref_b = hf_logits(family_dir, prefix + b).logits[0, n:]
    torch.testing.assert_close(tree, torch.cat([ref_a, ref_b]), atol=2e-4, rtol=2e-4)


def test_hidden_state_capture(family_dir):
    runner = load_runner(family_dir)
    out_last = OneRequest(runner).extend(IDS, capture="last")
    out_layers = OneRequest(runner).extend(IDS, capture=(0, 1))
    ref = hf_logits(family_dir, IDS, output_hidden_states=True).hidden_states
    # HF: hidden_states[i + 1] is the output of layer i; the last entry is after the final norm.
    torch.testing.assert_close(out_last.hidden, ref[-1][0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(out_layers.layer_hidden[0], ref[1][0], atol=2e-4, rtol=2e-4)
    assert out_last.logits.shape == (len(IDS), runner.config.vocab_size)


def test_bf16_runs_and_stays_close(tiny_model_dir):
    ref = OneRequest(load_runner(tiny_model_dir)).extend(IDS).logits
    ours = OneRequest(load_runner(tiny_model_dir, dtype="bfloat16")).extend(IDS).logits
    assert ours.dtype == torch.float32  # logits are always returned in fp32
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
