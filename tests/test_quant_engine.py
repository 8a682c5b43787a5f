"""The engine with quantized weights (tiny random model): speculative greedy output (EAGLE with a
head that guesses right, NGRAM) equals plain greedy output token for token, and a request batched
with others equals the same request alone; the KV invariant after every workload."""
from __future__ import annotations

import pytest
import torch

import specjet
from specjet.kernels import qgemm
from specjet.kernels.qgemm import QuantizedLinear
from test_spec_eagle import copy_head

PROMPTS = ["a b c a b c a b c a b", "The cat sat on the mat. The cat", "1 2 3 4 1 2", "Hello"]
PARAMS = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, cyclic_model_dir):
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, quantization=request.param) as eng:
        outs = [o["output_ids"] for o in eng.generate(PROMPTS, PARAMS)]
        alone = [eng.generate(p, PARAMS)["output_ids"] for p in PROMPTS[:2]]
        eng.check_kv_invariant()
        model = eng.worker.runner.model
        yield request.param, outs, alone, model


def test_every_projection_and_the_head_are_quantized(quantized):
    method, _, _, model = quantized
    assert model.quantization == method
    assert model.embed_tokens.weight.dtype == torch.float32  # the embedding lookup stays float
    from specjet.models.llama import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.packed, QuantizedLinear) for m in linears)
    head = model.lm_head.packed.weight
    assert type(head).__name__ == "DotInt8" and head.group == (32 if method == "int4" else 64)


def test_batched_equals_alone(quantized):
    _, outs, alone, _ = quantized
    assert outs[:2] == alone


@pytest.mark.parametrize("kwargs", [
    {"speculative_algorithm": "NGRAM"},
    {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 4, "speculative_num_steps": 3,
     "speculative_num_draft_tokens": 8, "page_size": 16},
])
def test_speculative_equals_plain(quantized, cyclic_model_dir, tmp_path, kwargs):
    method, expected, _, _ = quantized
    if kwargs["speculative_algorithm"] == "EAGLE":
        kwargs = dict(kwargs, speculative_draft_model_path=str(copy_head(tmp_path, cyclic_model_dir, expected)),
                      speculative_hybrid_ngram_tokens=0)
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=4096, quantization=method, **kwargs) as eng:
        outs = [o["output_ids"] for o in eng.generate(PROMPTS, PARAMS)]
        batched = eng.get_server_info()["stats"]
        alone = [eng.generate(p, PARAMS)["output_ids"] for p in PROMPTS]
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
        if kwargs["speculative_algorithm"] == "EAGLE":  # the draft head computes like its target
            head = eng.worker.speculator.drafter.head
            assert isinstance(head.fc.packed, QuantizedLinear)
            assert isinstance(head.target.lm_head.packed, QuantizedLinear)
    assert outs == expected and alone == expected
    # Drafts were taken, not only verified (alone: the learned drafters leave free text beside others to
    # a root-only tree on a quantized CPU target, SpecConfig.free_text_draft_batch).
    assert stats["spec_accepted_tokens"] - batched["spec_accepted_tokens"] > stats["spec_verify_ct"] - batched["spec_verify_ct"]
    if kwargs["speculative_algorithm"] == "EAGLE":
        assert batched["spec_accepted_tokens"] == batched["spec_verify_ct"]  # in the batch of 4: root-only trees


def test_quantized_needs_cpu_and_known_method(cyclic_model_dir):
    with pytest.raises(ValueError, match="int8, int4, gguf"):
        specjet.Engine(model_path=str(cyclic_model_dir), quantization="q4_0")
    with pytest.raises(ValueError, match="needs a GGUF model"):
        specjet.Engine(model_path=str(cyclic_model_dir), quantization="gguf", max_total_tokens=1024)


def test_kernels_are_in_use():
    assert qgemm.extension() is not None, "the C++ extension should be built by the package's set-up"


def test_only_projections_that_stay_float_get_float_operands(tmp_path, default_model_dir, monkeypatch):
    """A quantized model's load skips the float packing of the projections it quantizes (each float shape's row plan
    is checked by running it: seconds of an engine's start); a projection whose input width is not whole 32-weight
    blocks stays float and is packed as without quantization, and the model still answers as one that was packed
    in full first. The quantized projections' float weights are then freed."""
    from transformers import AutoConfig

    from conftest import make_tiny_model_dir
    from specjet.kernels import linear
    from specjet.kernels.fp32_gemm import Fp32Linear
    from specjet.kernels.linear import PackedLinear
    from specjet.models.config import ModelConfig
    from specjet.models.llama import Linear, LlamaForCausalLM
    from specjet.models.runner import ModelRunner
    from specjet.models.weights import load_state_dict
    from model_harness import OneRequest

    model_dir = make_tiny_model_dir(tmp_path / "m", default_model_dir, intermediate_size=80)  # down_proj: 80 inputs
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    float_kind = type(linear.pack_weight(torch.zeros(80, 64))).__name__  # specjet's float32 GEMM, or oneDNN's plans
    checked = []
    choose_plan = linear.choose_plan
    monkeypatch.setattr(linear, "choose_plan", lambda w, *a: checked.append(tuple(w.shape)) or choose_plan(w, *a))
    monkeypatch.setattr(linear, "_PLANS", {})  # every shape's plan checked anew here
    runner = ModelRunner(config, load_state_dict(model_dir), "float32", "cpu", 1024, 0.0, 1, quantization="int8")
    assert set(checked) <= {(80, 64)}  # no quantized projection's float plan was checked
    kinds = {name: type(m.packed).__name__ for name, m in runner.model.named_modules() if isinstance(m, Linear)}
    assert {n for n, k in kinds.items() if k == float_kind} == {f"layers.{i}.mlp.down_proj" for i in range(2)}
    assert all(k == "QuantizedLinear" for n, k in kinds.items() if not n.endswith("down_proj"))
    # The quantized projections' float weights are freed (nothing computes with them), the float ones' kept.
    float_weights = {n: m.weight_t for n, m in runner.model.named_modules() if isinstance(m, Linear)}
    assert all(w.is_meta == (kinds[n] == "QuantizedLinear") for n, w in float_weights.items())

    load_weights = LlamaForCausalLM.load_weights  # as before: every projection packed as float, then quantized
    monkeypatch.setattr(LlamaForCausalLM, "load_weights", lambda model, sd, pack=True, **kw: load_weights(model, sd, True, **kw))
    reference = ModelRunner(config, load_state_dict(model_dir), "float32", "cpu", 1024, 0.0, 1, quantization="int8")
    assert isinstance(reference.model.layers[0].mlp.down_proj.packed, (PackedLinear, Fp32Linear))
    ids = [1, 17, 923, 42, 7]
    assert torch.equal(OneRequest(runner).extend(ids).logits, OneRequest(reference).extend(ids).logits)


def test_a_projection_without_blocks_or_weight_is_refused(tiny_model_dir):
    """A projection left without its float weight (blocks were to replace it) and given no blocks fails loudly
    rather than quantizing an empty weight."""
    from specjet.models.quantize import quantize_linears
    from model_harness import load_runner

    model = load_runner(tiny_model_dir).model
    model.layers[1].mlp.down_proj.drop_float_weight()
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj has neither blocks of its own nor a float weight"):
        quantize_linears(model, "int8")


def test_a_model_none_of_whose_projections_can_be_quantized_is_refused(tmp_path, default_model_dir, caplog):
    """Input widths that are not whole 32-weight blocks stay float: where that is every projection, the method
    asked for would compute nothing (while the engine reported it), so the engine refuses it; where it is some,
    a warning says how many."""
    import logging

    from conftest import make_tiny_model_dir

    odd = make_tiny_model_dir(tmp_path / "odd", default_model_dir, hidden_size=80, intermediate_size=200)
    with pytest.raises(ValueError, match="none of the model's 9 projections"):
        specjet.Engine(model_path=str(odd), quantization="int4", max_total_tokens=1024)
    some = make_tiny_model_dir(tmp_path / "some", default_model_dir, intermediate_size=80)  # down_proj stays float
    with caplog.at_level(logging.WARNING, logger="specjet.models.quantize"):
        with specjet.Engine(model_path=str(some), quantization="int8", max_total_tokens=1024) as eng:
            assert eng.get_server_info()["quantization"] == "int8"
    assert "2 of 9 projections stay float" in caplog.text


def test_a_cpu_engine_gives_the_heap_its_load_freed_back(cyclic_model_dir, monkeypatch):
    """Quantizing frees each weight's float temporaries; glibc kept them resident (~0.6 GB of the default model's
    int8 engine, which then held about what its float32 engine did): the load gives them back once (malloc_trim)."""
    from specjet.engine import loading

    calls = []
    real = loading.release_freed_heap
    monkeypatch.setattr(loading, "release_freed_heap", lambda: calls.append(1) or real())
    with specjet.Engine(model_path=str(cyclic_model_dir), max_total_tokens=1024, quantization="int8") as eng:
        assert eng.generate("a b c", {"temperature": 0, "max_new_tokens": 2})["output_ids"]
        eng.check_kv_invariant()
    assert calls == [1]


def test_a_free_rows_tokens_do_not_depend_on_grammar_rows_beside_it_in_bf16(cyclic_model_dir):
    """int4 weights with bfloat16 activations: a batch holding a grammar row takes the LM head's masked call for
    every row, which gave float32 sums where the full call rounds them to bf16, so a free request's greedy tokens
    changed where two logits round alike (the cyclic model's at its 20th token). Alone, beside free requests, beside
    a regex and beside a JSON schema: the same ids."""
    free = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    regex = dict(free, ignore_eos=False, regex="(ab|cd|[0-9]){3,20}")
    schema = dict(free, ignore_eos=False, json_schema={
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
        "required": ["a", "b"], "additionalProperties": False})
    prompts = ["a b c a b c a b c a b", "The cat sat on the mat. The cat", "1 2 3 4 1 2", "Hello"]
    with specjet.Engine(model_path=str(cyclic_model_dir), quantization="int4", dtype="bfloat16",
                        max_total_tokens=4096, disable_guided_drafting=True) as eng:
        alone = eng.generate(prompts[0], free)["output_ids"]
        for batch, params in ((prompts, [free] * 4), (prompts[:1] * 2, [free, regex]), (prompts[:2], [free, schema]),
                              (prompts + prompts[:2], [free] * 4 + [regex, schema])):
            assert eng.generate(batch, params)[0]["output_ids"] == alone, params[1:]
        eng.check_kv_invariant()
