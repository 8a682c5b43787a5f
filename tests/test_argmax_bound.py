"""kernels/argmax_bound.py: an LM head's greedy rows computed only where their argmax can be (a float32 head, and a
bf16 one on the VDPBF16PS kernel).

The bound is checked against the int8 copy's actual error, the candidates against the whole head's argmax (ties,
bf16 roundings, grammar masks, non-finite rows included), the C++ pass against a float64 computation of the same
rule, and engines with the path against the same engines computing the whole head (ids equal, KV invariant
after)."""
from __future__ import annotations

import pytest
import torch

import specjet
from specjet.kernels import argmax_bound, bf16_gemm, cpu_ops
from specjet.kernels.argmax import argmax_rows
from specjet.kernels.argmax_bound import ArgmaxBound
from specjet.kernels.bf16_gemm import Bf16Linear
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
needs_vdpbf16 = pytest.mark.skipif(cpu_ops.extension() is None or "avx512_bf16" not in bf16_gemm.supported_isas(),
                                   reason="needs AVX-512 BF16 (the bf16 GEMM's VDPBF16PS kernel)")


@pytest.fixture
def vdpbf16_bf16(monkeypatch, request):
    """bf16 weights on the bf16 GEMM's VDPBF16PS kernel (the one whose masked rows a bf16 head's bound uses), also
    on a CPU whose default is AMX."""
    request.addfinalizer(bf16_gemm.default_isa.cache_clear)
    monkeypatch.setenv(bf16_gemm.ISA_ENV, "avx512_bf16")
    bf16_gemm.default_isa.cache_clear()


def bf16_head_and_rows(**kwargs):
    """``head_and_rows``'s head and rows in bf16, the head on the VDPBF16PS kernel."""
    head, x = head_and_rows(**kwargs)
    return Bf16Linear.build(head.weight_t().bfloat16(), None, "avx512_bf16"), x.bfloat16().contiguous()


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
@needs_vdpbf16
def test_a_bf16_heads_candidates_hold_its_argmax_and_get_its_bits():
    """Column 5 is column 9 with one weight a bf16 step smaller: on rows along column 9 the two lead, differ in
    float32 and round to one bf16 value, where the earlier column 5 is the whole head's argmax."""
    head, x = bf16_head_and_rows()
    w = head.weight_t()
    lead = (torch.randn(w.shape[0], generator=torch.Generator().manual_seed(3)) * 2).bfloat16()
    k = int(lead.float().abs().argsort()[len(lead) // 2])  # a weight of middling size
    w[:, 9] = lead
    w[:, 5] = lead
    w[k, 5] = (lead[k].float() * (1 - 2 ** -7)).bfloat16()
    head = Bf16Linear.build(w, None, "avx512_bf16")
    x[8:] = lead[None, :] * torch.linspace(0.5, 3, len(x) - 8)[:, None].bfloat16()
    bound = ArgmaxBound.build(head)
    assert bound is not None and bound.bf16_ties and bound.max_rows == argmax_bound.BF16_MAX_ROWS
    bound.max_rows = None  # every row of this call
    xf = x.float().contiguous()
    full = head(x).float()
    error = (full - bound.approx(xf)).abs()
    assert bool((error <= bound.bounds(xf) + full.abs() * 2 ** -8).all())  # the sum's bound and the bf16 rounding
    leads = argmax_rows(full)[8:]
    assert bool((leads == 5).any())  # the rounding tie the rule is for
    bitmask, flags = bound.narrow(xf, torch.ones(len(x), dtype=torch.bool))
    narrowed = head.masked(x, bitmask, flags)
    assert torch.equal(argmax_rows(narrowed), argmax_rows(full))
    kept = torch.isfinite(narrowed)
    assert torch.equal(narrowed[kept], full[kept])
    assert float(unpack_bits(bitmask, bound.vocab).sum(-1).float().median()) < 256


@needs_kernel
def test_bf16_ties_make_every_column_that_can_round_to_the_best_a_candidate():
    """No bound (zero factors): without bf16 ties the candidates are the maximum alone; with them, every column
    whose bf16 rounding equals the maximum's, and none more than two bf16 steps below it. The C++ pass and the
    torch reference agree."""
    g = torch.Generator().manual_seed(7)
    rows, vocab = 64, 512
    x = torch.randn(rows, 64, generator=g)
    top = torch.randn(rows, 1, generator=g) * 20
    top[0] = 1e-3
    approx = (top - torch.rand(rows, vocab, generator=g) * top.abs() * 2 ** -5).contiguous()
    factors = torch.zeros(3, vocab)
    ext = cpu_ops.extension()
    plain = unpack_bits(ext.argmax_candidates(x, approx, factors), vocab)
    tied = unpack_bits(ext.argmax_candidates(x, approx, factors, bf16_ties=True), vocab)
    best = approx.amax(-1, keepdim=True)
    same = approx.bfloat16() == best.bfloat16()
    assert torch.equal(plain, approx == best)
    assert bool((tied | ~same).all()) and bool((same & ~plain).any())
    floor = best - torch.ldexp(torch.ones_like(best), torch.frexp(best.abs()).exponent - 6)
    assert bool((~tied | (approx >= floor)).all()) and bool((~tied).any())
    reference = ArgmaxBound(head=None, approx=lambda _: approx, factors=factors, bf16_ties=True)
    assert torch.equal(reference.candidates(x), tied)


@needs_kernel
@needs_vdpbf16
def test_a_bf16_head_is_narrowed_only_in_calls_of_few_such_rows():
    head, x = bf16_head_and_rows(rows=12)
    bound = ArgmaxBound.build(head)
    xf = x.float().contiguous()
    many = torch.zeros(12, dtype=torch.bool)
    many[:bound.max_rows + 1] = True
    assert bound.narrow(xf, many) is None  # the whole head for every row
    grammar = (torch.full((12, bound.vocab // 32), -1, dtype=torch.int32), torch.zeros(12, dtype=torch.bool))
    assert bound.narrow(xf, many, grammar) is grammar  # counted before the grammar's rows: nothing else done
    few = torch.zeros(12, dtype=torch.bool)
    few[[2, 7]] = True
    bitmask, flags = bound.narrow(x, few)  # the bf16 rows themselves, widened inside
    assert flags.tolist() == few.tolist()
    assert torch.equal(argmax_rows(head.masked(x, bitmask, flags)), argmax_rows(head(x).float()))


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
    assert ArgmaxBound.build(Fp32Linear.build(weight, torch.zeros(256))) is None  # a bias: not in the int8 copy
    if "avx512_bf16" in bf16_gemm.supported_isas():
        assert ArgmaxBound.build(Bf16Linear.build(weight.bfloat16(), None, "avx512_bf16")) is not None
    if "amx" in bf16_gemm.supported_isas():  # AMX tiles: no kernel computes a row's listed columns with their bits
        assert ArgmaxBound.build(Bf16Linear.build(weight.bfloat16(), None, "amx")) is None
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


def _engine_outputs(model_dir, prompts, params, monkeypatch, bound: str, dtype: str = "float32", **kwargs):
    monkeypatch.setenv(argmax_bound.ENV, bound)
    with specjet.Engine(model_path=str(model_dir), dtype=dtype, quantization=None, max_total_tokens=4096,
                        **kwargs) as eng:
        model = eng.worker.runner.model
        assert (model.argmax_bound is not None) == (bound == "on")
        narrowed = []
        if bound == "on":  # record whether each of the head's calls narrowed rows
            real = model.argmax_bound.narrow

            def spy(x, rows, mask=None):
                result = real(x, rows, mask)
                narrowed.append(result is not mask)
                return result

            monkeypatch.setattr(model.argmax_bound, "narrow", spy)
        outputs = eng.generate(input_ids=prompts, sampling_params=params)
        if bound == "on":
            assert any(narrowed)
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
    # Every request's ids, the seeded sampled one's too (its tokens are drawn with their positions' coins, whatever
    # trees it verifies: kernels/coins.py).
    assert on == off
    # Greedy alone: every request's rows narrowed (no sampled neighbour): the whole head's ids, and plain decoding's
    # (an engine without drafts, the whole head) for the speculative ones.
    alone = [greedy] * len(prompts)
    narrowed = _engine_outputs(tiny_model_dir, prompts, alone, monkeypatch, "on", **kwargs)
    assert narrowed == _engine_outputs(tiny_model_dir, prompts, alone, monkeypatch, "off", **kwargs)
    plain = _engine_outputs(tiny_model_dir, prompts, alone, monkeypatch, "off", disable_guided_drafting=True,
                            disable_free_text_drafting=True, disable_overlap_schedule=True)
    assert narrowed == plain


@needs_kernel
@needs_vdpbf16
@pytest.mark.parametrize("algorithm,overlap", [(None, False), (None, True), ("NGRAM", False)])
def test_bf16_engines_with_the_bound_decode_the_whole_heads_ids(tiny_model_dir, vdpbf16_bf16, monkeypatch, algorithm,
                                                                overlap):
    """bf16 engines on the VDPBF16PS kernel: decode steps of a mixed batch (three greedy rows, one sampled) and
    NGRAM's verifies of few rows narrowed, the same ids as the whole head, and as plain decoding for NGRAM."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4], [9, 10, 11, 9, 10, 11, 9, 10], [20, 21], [30, 31, 32]]
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    params = [greedy, {**greedy, "json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'},
              {"temperature": 0.8, "seed": 3, "max_new_tokens": 24, "ignore_eos": True}, greedy]
    kwargs = {"disable_overlap_schedule": not overlap, "dtype": "bfloat16"}
    if algorithm is not None:
        kwargs.update(speculative_algorithm=algorithm, speculative_num_draft_tokens=3)
    on = _engine_outputs(tiny_model_dir, prompts, params, monkeypatch, "on", **kwargs)
    off = _engine_outputs(tiny_model_dir, prompts, params, monkeypatch, "off", **kwargs)
    assert [on[i] for i in (0, 1, 3)] == [off[i] for i in (0, 1, 3)]
    if algorithm is not None:
        plain = _engine_outputs(tiny_model_dir, prompts, [greedy] * 4, monkeypatch, "off", dtype="bfloat16",
                                disable_guided_drafting=True, disable_free_text_drafting=True)
        assert _engine_outputs(tiny_model_dir, prompts, [greedy] * 4, monkeypatch, "on", **kwargs) == plain


@needs_kernel
@needs_vdpbf16
def test_the_default_model_in_bf16_decodes_the_same_ids_with_the_bound(default_model_dir, vdpbf16_bf16, monkeypatch):
    """The embedded model's float weights in bf16 on the VDPBF16PS kernel, plain greedy decoding of a chat reply
    and of a JSON object under its schema, alone and together: the narrowed head gives the whole head's ids."""
    prompts, params = _default_model_requests(default_model_dir)
    kwargs = {"dtype": "bfloat16", "disable_guided_drafting": True, "disable_free_text_drafting": True}
    on = _engine_outputs(default_model_dir, prompts, params, monkeypatch, "on", **kwargs)
    off = _engine_outputs(default_model_dir, prompts, params, monkeypatch, "off", **kwargs)
    assert on == off and all(len(ids) > 8 for ids in on)
    assert _engine_outputs(default_model_dir, prompts[:1], params[:1], monkeypatch, "on", **kwargs) == on[:1]


def _default_model_requests(default_model_dir):
    """Two chat prompts of the embedded model, the second's reply under a JSON schema: (ids, sampling params)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    questions = ["Tom has 3 apples and buys 5 more. How many apples does he have?",
                 "Give a JSON object with a name and an age for a fictional person."]
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True))["input_ids"] for q in questions]
    greedy = {"temperature": 0.0, "max_new_tokens": 48}
    schema = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, ' \
             '"required": ["name", "age"]}'
    return prompts, [greedy, {**greedy, "json_schema": schema}]


@needs_kernel
@pytest.mark.parametrize("algorithm", [None, "DFLASH"])
def test_the_default_model_in_float32_decodes_the_same_ids_with_the_bound(default_model_dir, monkeypatch, algorithm):
    """The embedded model in float32, greedy chat replies and a JSON object under its schema, plain decoding and
    the shipped DFlash draft: the narrowed head gives the whole head's ids."""
    prompts, params = _default_model_requests(default_model_dir)
    kwargs = {} if algorithm is None else {"speculative_algorithm": algorithm}
    on = _engine_outputs(default_model_dir, prompts, params, monkeypatch, "on", **kwargs)
    off = _engine_outputs(default_model_dir, prompts, params, monkeypatch, "off", **kwargs)
    assert on == off and all(len(ids) > 8 for ids in on)
