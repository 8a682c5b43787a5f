"""kernels/argmax_bound.py: a float32 head's greedy rows computed only where their argmax can be.

The bound is checked against the int8 copy's actual error, the candidates against the whole head's argmax (ties,
grammar masks, non-finite rows included), the C++ pass against a float64 computation of the same rule, and
engines with the path against the same engines computing the whole head (ids equal, KV invariant after)."""
from __future__ import annotations

import pytest
import torch

import specjet
from specjet.kernels import argmax_bound, cpu_ops
from specjet.kernels.argmax import argmax_rows
from specjet.kernels.argmax_bound import ArgmaxBound
from specjet.kernels.token_bitmask import allowed_counts
from specjet.kernels.fp32_gemm import Fp32Linear, default_isa
from specjet.kernels.linear import pack_onednn

_SHIFTS = torch.arange(32, dtype=torch.int64)


def pack_bits(chosen: torch.Tensor) -> torch.Tensor:
    """bool [R, V] -> an int32 [R, ceil(V / 32)] token bitmask (xgrammar's layout)."""
    rows, vocab = chosen.shape
    words = -(-vocab // 32)
    chosen = torch.nn.functional.pad(chosen, (0, words * 32 - vocab))
    packed = (chosen.view(rows, words, 32).to(torch.int64) << _SHIFTS).sum(-1)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def unpack_bits(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (bitmask.to(torch.int64).unsqueeze(-1) >> _SHIFTS) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


needs_kernel = pytest.mark.skipif(cpu_ops.extension() is None or default_isa() == "onednn",
                                  reason="needs the C++ extension's float32 GEMM")


def head_and_rows(k: int = 128, vocab: int = 4096, rows: int = 40, seed: int = 0):
    """A head with spread column scales and an outlier weight per column, rows of mixed magnitudes (a zero block,
    a spike), and two duplicated columns (exact ties)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, k, generator=g) * torch.rand(vocab, 1, generator=g) * 0.1
    weight[torch.arange(vocab), torch.randint(0, k, (vocab,), generator=g)] *= 25
    weight[3] = torch.randn(k, generator=g)
    weight[7] = weight[3]  # columns 3 and 7 tie exactly on every row
    x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
    x[1, :32] = 0
    x[2, 5] = 300.0
    x[3] = weight[3] * 4  # column 3 (and 7) win row 3 by far
    return Fp32Linear.build(weight.t().contiguous()), x.contiguous()


@needs_kernel
def test_the_int8_copys_error_stays_within_the_bound():
    for seed in range(3):
        head, x = head_and_rows(seed=seed)
        bound = ArgmaxBound.build(head)
        error = (head(x) - bound.approx(x)).abs()
        assert bool((error <= bound.bounds(x)).all())
        assert float((error / bound.bounds(x)).max()) > 0.01  # a bound, not a wall far from the error


@needs_kernel
def test_the_candidates_hold_the_whole_heads_argmax_and_get_its_bits():
    head, x = head_and_rows()
    bound = ArgmaxBound.build(head)
    full = head(x)
    bitmask, flags = bound.narrow(x, torch.ones(len(x), dtype=torch.bool))
    assert bool(flags.all())
    narrowed = head.masked(x, bitmask, flags)
    assert torch.equal(argmax_rows(narrowed), argmax_rows(full))
    assert int(argmax_rows(full)[3]) == 3  # the tie goes to the first column, in both
    kept = torch.isfinite(narrowed)
    assert torch.equal(narrowed[kept], full[kept])
    chosen = unpack_bits(bitmask, full.shape[1])
    assert torch.equal(kept, chosen)
    assert bool(chosen[3, 7])  # the tied column is a candidate too
    assert float(chosen.sum(-1).float().median()) < 64  # a few columns, not the head


@needs_kernel
def test_the_c_pass_chooses_the_rule_computed_in_float64():
    head, x = head_and_rows(rows=24, seed=1)
    bound = ArgmaxBound.build(head)
    approx = bound.approx(x)
    chosen = unpack_bits(cpu_ops.extension().argmax_candidates(x, approx, bound.factors), bound.vocab)
    blocks = x.double().view(len(x), -1, 32).abs()
    features = torch.cat([blocks.sum((1, 2))[:, None], blocks.amax(-1) * (0.5005 / 127)], dim=1)
    b = features @ bound.factors.double()
    a = approx.double()
    upper, limit = a + b, (a - b).amax(-1, keepdim=True)
    expected = upper >= limit
    near = (upper - limit).abs() <= 1e-5 * (a.abs() + b + 1)
    assert torch.equal(chosen[~near], expected[~near])
    assert torch.equal(bound.candidates(x)[~near], expected[~near])  # the torch reference: the same rule
    assert int(expected.sum()) < expected.numel() // 20


@needs_kernel
def test_grammar_rows_keep_their_allowed_tokens_and_their_masked_argmax():
    head, x = head_and_rows(rows=12, seed=2)
    bound = ArgmaxBound.build(head)
    full = head(x)
    g = torch.Generator().manual_seed(5)
    allowed = torch.rand(len(x), bound.vocab, generator=g) < 0.3
    allowed[4] = False
    allowed[4, [100, 2000, 4095]] = True  # a sparse row
    grammar_rows = torch.ones(len(x), dtype=torch.bool)
    grammar_rows[6] = False  # a request without a grammar in the same batch
    argmax_only = torch.ones(len(x), dtype=torch.bool)
    argmax_only[8] = False  # a row that reports logprobs: its grammar row and flag stay
    mask = (pack_bits(allowed), grammar_rows)
    bitmask, flags = bound.narrow(x, argmax_only, mask)
    assert torch.equal(bitmask[8], mask[0][8]) and bool(flags[8])
    assert torch.equal(bitmask[4], mask[0][4])  # already sparse: the masked kernel computes its 3 columns alone
    assert int(unpack_bits(bitmask, bound.vocab)[0].sum()) < int(allowed[0].sum()) // 10  # a dense row narrowed
    narrowed = head.masked(x, bitmask, flags)
    chosen = unpack_bits(bitmask, bound.vocab)
    for r in range(len(x)):
        if r == 8:
            continue
        legal = allowed[r] if grammar_rows[r] else torch.ones(bound.vocab, dtype=torch.bool)
        assert not bool((chosen[r] & ~legal).any())
        expected = torch.where(legal, full[r], float("-inf")).argmax()
        assert int(narrowed[r].argmax()) == int(expected)


@needs_kernel
def test_a_grammar_mask_of_another_width_is_left_as_it_is():
    head, x = head_and_rows(rows=4)
    bound = ArgmaxBound.build(head)
    other = (torch.full((4, 100), -1, dtype=torch.int32), torch.tensor([True, False, True, False]))
    assert bound.narrow(x, torch.ones(4, dtype=torch.bool), other) is other  # nothing narrowed, nothing refused


@needs_kernel
def test_a_row_without_a_certificate_is_computed_whole():
    head, x = head_and_rows(rows=4)
    x[2, 0] = float("nan")
    bound = ArgmaxBound.build(head)
    bitmask, flags = bound.narrow(x, torch.ones(4, dtype=torch.bool))
    assert int(unpack_bits(bitmask, bound.vocab)[2].sum()) == bound.vocab
    narrowed, full = head.masked(x, bitmask, flags), head(x)
    assert torch.equal(narrowed[2].isnan(), full[2].isnan())
    assert torch.equal(argmax_rows(narrowed), argmax_rows(full))


def test_bitmask_counts_in_xgrammars_layout():
    chosen = torch.zeros(2, 70, dtype=torch.bool)
    chosen[0, [0, 31, 32, 69]] = True
    chosen[1, :] = True
    words = pack_bits(chosen)
    assert words.dtype == torch.int32 and words.shape == (2, 3)
    assert words[0].tolist() == [1 | -(1 << 31), 1, 1 << 5]
    assert words[1].tolist() == [-1, -1, (1 << 6) - 1]
    assert torch.equal(unpack_bits(words, 70), chosen)
    assert allowed_counts(words).tolist() == [4, 70]


@needs_kernel
def test_which_heads_get_a_bound(monkeypatch):
    weight = torch.randn(64, 256)
    assert ArgmaxBound.build(Fp32Linear.build(weight)) is not None
    assert ArgmaxBound.build(pack_onednn(weight, None)) is None  # not the float32 GEMM
    assert ArgmaxBound.build(Fp32Linear.build(torch.randn(48, 256))) is None  # 48 wide: not whole 32-blocks
    monkeypatch.setenv(argmax_bound.ENV, "off")
    assert ArgmaxBound.build(Fp32Linear.build(weight)) is None
    monkeypatch.setenv(argmax_bound.ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECJET_ARGMAX_BOUND"):
        ArgmaxBound.build(Fp32Linear.build(weight))


@needs_kernel
def test_the_c_pass_refuses_wrong_arguments():
    ext = cpu_ops.extension()
    x, approx, factors = torch.randn(2, 64), torch.randn(2, 100), torch.rand(3, 100)
    with pytest.raises(RuntimeError, match="whole blocks of 32"):
        ext.argmax_candidates(torch.randn(2, 48), approx, factors)
    with pytest.raises(RuntimeError, match="a row per row of x"):
        ext.argmax_candidates(x, torch.randn(3, 100), factors)
    with pytest.raises(RuntimeError, match=r"factors must be"):
        ext.argmax_candidates(x, approx, torch.rand(4, 100))
    with pytest.raises(RuntimeError, match="go together"):
        ext.argmax_candidates(x, approx, factors, torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="allowed must be"):
        ext.argmax_candidates(x, approx, factors, torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.bool))
    assert ext.argmax_candidates(x, approx, factors).shape == (2, 4)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, tiny_model_dir):
    from test_spec_eagle import random_head

    return random_head(tmp_path_factory.mktemp("bound-head"), tiny_model_dir)


@pytest.fixture(scope="module")
def dflash_draft(tmp_path_factory, tiny_model_dir):
    from test_dflash_spec import make_wrong_draft

    return make_wrong_draft(tmp_path_factory.mktemp("bound-dflash"), tiny_model_dir)


def _engine_outputs(model_dir, prompts, params, monkeypatch, bound: str, **kwargs):
    monkeypatch.setenv(argmax_bound.ENV, bound)
    with specjet.Engine(model_path=str(model_dir), dtype="float32", quantization=None, max_total_tokens=4096,
                        **kwargs) as eng:
        model = eng.worker.runner.model
        assert (model.argmax_bound is not None) == (bound == "on")
        narrowed = []
        if bound == "on":  # count the head's calls that narrowed rows
            real = model.argmax_bound.narrow
            monkeypatch.setattr(model.argmax_bound, "narrow", lambda *a, **k: narrowed.append(1) or real(*a, **k))
        outputs = eng.generate(input_ids=prompts, sampling_params=params)
        if bound == "on":
            assert narrowed
        eng.check_kv_invariant()
    return [o["output_ids"] for o in outputs]


@needs_kernel
@pytest.mark.parametrize("algorithm,overlap", [(None, False), (None, True), ("NGRAM", False), ("NGRAM", True),
                                               ("EAGLE", True), ("DFLASH", False)])
def test_engines_with_the_bound_decode_the_whole_heads_ids(tiny_model_dir, eagle_head, dflash_draft, monkeypatch,
                                                           algorithm, overlap):
    """Greedy float32 engines, plain and speculative, on both loops: the same ids with the narrowed head as with
    the whole head, in a mixed batch of greedy and sampled requests, one with logprobs, one under a JSON grammar;
    an all-greedy batch's ids equal plain decoding's with the whole head."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4], [9, 10, 11, 9, 10, 11, 9, 10], [20, 21], [30, 31, 32]]
    greedy = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    params = [greedy, {**greedy, "return_logprob": True},
              {"temperature": 0.8, "seed": 3, "max_new_tokens": 20, "ignore_eos": True},
              {**greedy, "json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}]
    kwargs = {"disable_overlap_schedule": not overlap}
    if algorithm is not None:
        kwargs.update(speculative_algorithm=algorithm, speculative_measured_payoff=False)
    if algorithm == "EAGLE":
        kwargs.update(speculative_draft_model_path=str(eagle_head), speculative_num_steps=2, speculative_eagle_topk=2,
                      speculative_num_draft_tokens=6)
    if algorithm == "DFLASH":
        kwargs.update(speculative_draft_model_path=str(dflash_draft), speculative_draft_min_prob=0.0)
    on = _engine_outputs(tiny_model_dir, prompts, params, monkeypatch, "on", **kwargs)
    off = _engine_outputs(tiny_model_dir, prompts, params, monkeypatch, "off", **kwargs)
    # The greedy requests' ids (the sampled one's draws follow its trees' shapes, which DFLASH's lone-request
    # trees tie to when its neighbours finish: equal in distribution, not id for id, with or without the bound).
    assert [on[i] for i in (0, 1, 3)] == [off[i] for i in (0, 1, 3)]
    # Greedy alone: every request's rows narrowed (no sampled neighbour): the whole head's ids, and plain decoding's
    # (an engine without drafts, the whole head) for the speculative ones.
    alone = [greedy] * len(prompts)
    narrowed = _engine_outputs(tiny_model_dir, prompts, alone, monkeypatch, "on", **kwargs)
    assert narrowed == _engine_outputs(tiny_model_dir, prompts, alone, monkeypatch, "off", **kwargs)
    plain = _engine_outputs(tiny_model_dir, prompts, alone, monkeypatch, "off", disable_guided_drafting=True,
                            disable_free_text_drafting=True, disable_overlap_schedule=True)
    assert narrowed == plain


@needs_kernel
@pytest.mark.parametrize("algorithm", [None, "DFLASH"])
def test_the_default_model_in_float32_decodes_the_same_ids_with_the_bound(default_model_dir, monkeypatch, algorithm):
    """The embedded model in float32, greedy chat replies and a JSON object under its schema, plain decoding and
    the shipped DFlash draft: the narrowed head gives the whole head's ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    questions = ["Tom has 3 apples and buys 5 more. How many apples does he have?",
                 "Give a JSON object with a name and an age for a fictional person."]
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True))["input_ids"] for q in questions]
    greedy = {"temperature": 0.0, "max_new_tokens": 48}
    schema = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, ' \
             '"required": ["name", "age"]}'
    params = [greedy, {**greedy, "json_schema": schema}]
    kwargs = {} if algorithm is None else {"speculative_algorithm": algorithm}
    on = _engine_outputs(default_model_dir, prompts, params, monkeypatch, "on", **kwargs)
    off = _engine_outputs(default_model_dir, prompts, params, monkeypatch, "off", **kwargs)
    assert on == off and all(len(ids) > 8 for ids in on)
