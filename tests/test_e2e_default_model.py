"""End to end on the real default model (SmolLM2-135M-Instruct): exact agreement with Hugging Face
transformers' greedy generate, and schema-valid JSON on the shared dev set."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

import specjet

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips to her friends in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "List three primary colours.",
    "Explain in two sentences why the sky is blue, and mention Rayleigh scattering by name please.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def engine():
    # The float32 model, as the HF oracle runs: dtype auto would be bf16 on a CPU with native bf16,
    # quantization auto the GGUF's blocks with int8 activations (tests/test_e2e_quant.py covers those).
    with specjet.Engine(max_total_tokens=16384, dtype="float32", quantization=None) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_greedy(default_model_dir, engine):
    """HF transformers' own greedy generate, one prompt at a time (no padding), as the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    outs = []
    for q in QUESTIONS:
        ids = engine.tokenizer(engine.apply_chat_template(q), return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_equals_hf_generate(engine, hf_greedy, page_size):
    prompts = [engine.apply_chat_template(q) for q in QUESTIONS]
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    if page_size == 1:
        outs = engine.generate(prompts, params)  # one batch, mixed prompt lengths
        engine.check_kv_invariant()
    else:
        with specjet.Engine(max_total_tokens=16384, page_size=page_size, dtype="float32", quantization=None) as paged:
            outs = paged.generate(prompts, params)
            paged.check_kv_invariant()
    ours = [o["output_ids"] for o in outs]
    # HF stops after emitting EOS; so do we (finish_reason stop, EOS included in output_ids).
    assert ours == hf_greedy
    assert sum(map(len, ours)) > 150  # real work was compared, not a row of immediate EOS


# Dev-set schemas the model completes within the budget under greedy decoding, from each band that has them (none
# of the hard ones within 160 tokens in float32).
SCHEMA_SAMPLE = ["002_Glaiveai2K.json", "005_Glaiveai2K.json", "012_Github_easy.json", "018_Github_easy.json",
                 "024_Github_medium.json", "030_Github_medium.json", "agent_03.json", "agent_05.json"]


def test_json_schema_outputs_validate(engine, dev_schemas):
    entries = [e for e in dev_schemas if e["file"] in SCHEMA_SAMPLE]
    assert len(entries) == len(SCHEMA_SAMPLE)
    prompts = [engine.apply_chat_template(e["prompt"]) for e in entries]
    params = [{"temperature": 0, "max_new_tokens": 160, "json_schema": e["schema"]} for e in entries]
    outs = engine.generate(prompts, params)
    for entry, out in zip(entries, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", entry["file"]
        jsonschema.validate(json.loads(out["text"]), entry["schema"])
    engine.check_kv_invariant()


def test_regex_and_free_text_in_one_batch(engine):
    prompts = [engine.apply_chat_template("What is your favourite number?"), engine.apply_chat_template("Say hi.")]
    pattern = r"My favourite number is [0-9]{1,3}\."
    outs = engine.generate(prompts, [{"temperature": 0, "max_new_tokens": 40, "regex": pattern},
                                     {"temperature": 0, "max_new_tokens": 40}])
    assert re.fullmatch(pattern, outs[0]["text"])
    assert outs[1]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    engine.check_kv_invariant()


def test_sampled_json_is_valid(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    prompt = engine.apply_chat_template("Invent a person and give their name and age as JSON.")
    outs = engine.generate([prompt] * 4, [{"temperature": 0.8, "top_p": 0.95, "seed": s, "max_new_tokens": 60,
                                           "json_schema": schema} for s in range(4)])
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), schema)
    engine.check_kv_invariant()
