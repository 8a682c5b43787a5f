"""Models other than the default: Llama-family configs and GGUF files as users bring them. Each variant specjet
computes matches transformers (or the same file's float weights); each it does not compute is refused at start,
naming what, rather than run as another model."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import specjet
from gguf_writer import default_over_scaled_inv_freq, write_gguf
from model_harness import OneRequest, load_runner
from specjet.models.config import ModelConfig
from test_model import IDS, hf_logits


def tiny_dir(path, tokenizer_dir, model_type="llama", tie=True, **extra):
    """A 2-layer random model of ``model_type`` with config fields ``extra``, sharing the default tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() == 2 else None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}])
def test_rope_scaling_matches_transformers(tmp_path, default_model_dir, rope):
    """Every Llama 3.1/3.2 checkpoint sets rope_scaling; building the model on the meta device made transformers'
    RoPE functions fail ("Cannot copy out of meta tensor")."""
    model_dir = tiny_dir(tmp_path, default_model_dir, rope_scaling=rope)
    ours = OneRequest(load_runner(model_dir)).extend(IDS).logits
    torch.testing.assert_close(ours, hf_logits(model_dir, IDS).logits[0], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("model_type, extra, named", [
    ("llama", {"attention_bias": True}, "attention_bias"), ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("llama", {"mlp_bias": True}, "mlp_bias"), ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'")])
def test_variants_it_does_not_compute_are_refused(model_type, extra, named):
    """These configs ran with their extra biases dropped or SiLU in place of their activation: another model."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **extra)
    with pytest.raises(ValueError, match=f"unsupported {model_type} variant: {named}"):
        ModelConfig.from_hf(config)
    ModelConfig.from_hf(AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256))


def test_a_checkpoint_weight_never_read_is_refused_and_a_missing_one_named(tmp_path, default_model_dir):
    model_dir = tiny_dir(tmp_path / "m", default_model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    save_file(dict(tensors, **{"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}),
              str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weights this model does not compute .*o_proj.bias"):
        load_runner(model_dir)
    save_file({k: v for k, v in tensors.items() if k != "model.embed_tokens.weight"},
              str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="weight embed_tokens.weight is missing from the checkpoint"):
        load_runner(model_dir)


def test_a_sliding_window_caps_the_context(tmp_path, default_model_dir):
    """specjet attends to the whole context, which is a sliding-window model's attention only within its window:
    the context stops there (Mistral 7B v0.1's 4096 of its 32768), and a longer one asked for is refused."""
    model_dir = tiny_dir(tmp_path, default_model_dir, model_type="mistral", sliding_window=64)
    with specjet.Engine(model_path=str(model_dir), max_total_tokens=1024) as eng:
        assert eng.scheduler.config.context_len == 64
        with pytest.raises(ValueError, match="does not fit the context length 64"):
            eng.generate(input_ids=[list(range(5, 70))], sampling_params={"max_new_tokens": 1})
        eng.check_kv_invariant()
    with pytest.raises(ValueError, match="longer than the model's sliding_window"):
        specjet.Engine(model_path=str(model_dir), max_total_tokens=1024, context_length=128)


def test_generation_configs_end_of_turn_ids_end_replies(tmp_path, default_model_dir):
    """Llama 3's instruct models list <|eot_id|> only in generation_config.json: replies ran to the token limit."""
    model_dir = tiny_dir(tmp_path, default_model_dir)
    params = {"temperature": 0, "max_new_tokens": 8}
    with specjet.Engine(model_path=str(model_dir), max_total_tokens=1024) as eng:
        first = eng.generate("Hello there", params)["output_ids"]
        eng.check_kv_invariant()
    assert len(first) == 8 and first[0] != first[1]
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(dict(config, eos_token_id=[config["eos_token_id"],
                                                                                            first[1]])))
    with specjet.Engine(model_path=str(model_dir), max_total_tokens=1024) as eng:
        out = eng.generate("Hello there", params)
        stops = eng.scheduler.grammar_backend.tokenizer_info.stop_token_ids  # a grammar may end with it too
        eng.check_kv_invariant()
    assert out["output_ids"] == first[:2] and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert first[1] in stops and config["eos_token_id"] in stops


def test_a_bos_the_chat_template_wrote_is_not_added_again(tmp_path, default_model_dir):
    """A tokenizer that adds BOS (Llama's, Mistral's) beside a chat template that starts with {{ bos_token }} (theirs)
    gave every chat prompt two; a raw prompt still gets the tokenizer's."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from specjet.engine.engine import prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    bos = tokenizer.convert_ids_to_tokens(0)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, 0)])
    tokenizer.bos_token = bos
    text = "hello world"
    assert tokenizer(text)["input_ids"][0] == 0 and tokenizer(bos + text)["input_ids"][:2] == [0, 0]
    assert prompt_token_ids(tokenizer, bos + text) == tokenizer(text)["input_ids"]
    assert prompt_token_ids(tokenizer, text) == tokenizer(text)["input_ids"]
    assert prompt_token_ids(tokenizer, bos + bos + text)[:2] == [0, 0]  # two written: both kept, none added


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory, default_model_dir):
    return tiny_dir(tmp_path_factory.mktemp("qwen2"), default_model_dir, model_type="qwen2", tie=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_computed_with_its_own_blocks_matches_its_float_weights(tmp_path, default_model_dir, qwen2_dir,
                                                                       monkeypatch, arch):
    """llama.cpp permutes q and k rows only for its "llama" architecture; undoing it on a Qwen2 file scrambled every
    head (the first token already wrong). The blocks' output against the same file's dequantized weights."""
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = qwen2_dir if arch == "qwen2" else tiny_dir(tmp_path / "llama", default_model_dir, tie=False)
    path = write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", arch)
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    prompts = [IDS, IDS[:6]]
    outs = {}
    for quantization in (None, "gguf"):
        with specjet.Engine(model_path=str(path), dtype="float32", quantization=quantization,
                            max_total_tokens=1024) as eng:
            outs[quantization] = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                              top_logprobs_num=5)
            eng.check_kv_invariant()
    for float_out, block_out in zip(outs[None], outs["gguf"]):
        # The first token's distribution (its top 5 from each path; robust to a near-tie's flip, on any CPU), then
        # each token's logprob while the two paths agree on the ids.
        tops = [{t: lp for lp, t, _ in out["meta_info"]["output_top_logprobs"][0]} for out in (float_out, block_out)]
        shared = set(tops[0]) & set(tops[1])
        assert len(shared) >= 3 and max(abs(tops[0][t] - tops[1][t]) for t in shared) < 0.3, tops
        for (a, ta, _), (b, tb, _) in zip(float_out["meta_info"]["output_token_logprobs"],
                                           block_out["meta_info"]["output_token_logprobs"]):
            assert abs(a - b) < 0.3, (a, b)
            if ta != tb:
                break


def test_a_ggufs_rope_frequency_factors_are_applied(tmp_path, default_model_dir, monkeypatch):
    """A Llama 3.1/3.2 GGUF carries its RoPE scaling as a rope_freqs tensor, which transformers' GGUF reader drops."""
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8}
    hf_dir = tiny_dir(tmp_path / "hf", default_model_dir, tie=False, rope_scaling=rope)
    path = write_gguf(hf_dir, tmp_path / "tiny-rope.gguf", "llama", kind="F32",
                      rope_freqs=default_over_scaled_inv_freq(hf_dir))
    from specjet.models.weights import resolve_model_path

    ours = OneRequest(load_runner(resolve_model_path(path))).extend(IDS).logits  # the GGUF converted
    torch.testing.assert_close(ours, hf_logits(hf_dir, IDS).logits[0], atol=2e-4, rtol=2e-4)
