"""bench.latency --llamacpp: llama.cpp (llama-cpp-python, an optional extra CI does not install) timed on
the default model's GGUF beside specjet. The parts that need no llama.cpp always run; the end-to-end
ones where it is installed."""
from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest

from bench import llamacpp_system
from bench.decode_rate import Prompt
from test_bench_latency import run_bench

needs_llamacpp = pytest.mark.skipif(not llamacpp_system.available(), reason="llama-cpp-python not installed")


def test_a_missing_llamacpp_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # unimportable, installed or not
    assert not llamacpp_system.available()
    with pytest.raises(SystemExit, match=r"pip install -e '\.\[bench-llamacpp\]'"):
        llamacpp_system.require()


def test_llamacpp_needs_a_gguf_model(tiny_model_dir):
    from bench.latency import main

    if not llamacpp_system.available():
        pytest.skip("llama-cpp-python not installed: the GGUF check comes after the install check")
    with pytest.raises(SystemExit, match="needs a GGUF model"):
        main(["--model-path", str(tiny_model_dir), "--llamacpp", "--skip-hf", "--num-prompts", "1",
              "--max-new-tokens", "4", "--batch-sizes", "1", "--repeats", "1"])


@pytest.fixture(scope="module")
def llamacpp():
    from specjet.models.weights import default_gguf_path

    system = llamacpp_system.LlamaCppSystem(default_gguf_path(), n_threads=2, n_ctx=1024)
    yield system
    system.close()


@needs_llamacpp
def test_exactly_n_greedy_tokens(llamacpp, default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    prompt = Prompt(tok("The capital of France is")["input_ids"])
    first = llamacpp.generate([prompt], 8)[0]
    assert first["meta_info"]["completion_tokens"] == 8 and len(first["output_ids"]) == 8
    assert llamacpp.generate([prompt], 8)[0]["output_ids"] == first["output_ids"]  # greedy: the same again


@needs_llamacpp
def test_schema_constrained_output_validates(llamacpp, default_model_dir):
    from transformers import AutoTokenizer

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    assert llamacpp_system.grammar_survives(json.dumps(schema))
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                   add_generation_prompt=True, tokenize=False)
    out = llamacpp.generate([Prompt(tok(text)["input_ids"], json.dumps(schema))], 96)[0]
    jsonschema.validate(json.loads(tok.decode(out["output_ids"])), schema)


@needs_llamacpp
@pytest.mark.e2e
def test_latency_times_llamacpp_at_batch_one_beside_specjet(tmp_path):
    result_file = tmp_path / "latency.jsonl"
    # enough tokens that t_N - t_1 stands clear of the noise of a loaded machine (12 once read as n/a)
    stdout = run_bench("--llamacpp", "--skip-hf", "--batch-sizes", "1", "2", "--max-new-tokens", "48",
                       "--repeats", "1", "--num-prompts", "2", "--result-file", str(result_file), timeout=400)
    assert re.search(r"^llama\.cpp\s+1\s+[\d.]+", stdout, re.M)
    assert not re.search(r"^llama\.cpp\s+2\s", stdout, re.M)  # one sequence at a time: batch 1 only
    assert re.search(r"^specjet/llama\.cpp: bs1 [\d.]+x$", stdout, re.M)
    record = json.loads(result_file.read_text())
    assert {(r["system"], r["batch_size"]) for r in record["results"]} == {
        ("specjet", 1), ("specjet", 2), ("llama.cpp", 1)}
