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


@pytest.fixture(scope="module")
def qwen3_dirs(tmp_path_factory, default_model_dir):
    """Tiny Qwen3 models whose heads are 32 wide where hidden_size / heads is 16 (so the file's attention.key_length
    decides the shapes, as a real Qwen3's 128 does), with Qwen3's RoPE base 1e6 (not its config class's default) and
    random norm weights (q_norm and k_norm among them: one dropped, swapped or applied at the wrong width changes the
    output): untied, tied, and "cyclic" (untied, its matrices a third as large, so that its greedy text falls into
    cycles and n-gram drafts are taken)."""
    root = tmp_path_factory.mktemp("qwen3")
    dirs = {}
    for name, tie, scale in (("untied", False, 1.0), ("tied", True, 1.0), ("cyclic", False, 1 / 3)):
        path = tiny_dir(root / name, default_model_dir, model_type="qwen3", tie=tie, head_dim=32, rope_theta=1e6)
        tensors = load_file(path / "model.safetensors")
        generator = torch.Generator().manual_seed(1)
        for key, tensor in tensors.items():
            if key.endswith("norm.weight"):
                tensors[key] = 1 + 0.3 * torch.randn(tensor.shape, generator=generator)
            elif tensor.dim() == 2:
                tensors[key] = tensor * scale
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        dirs[name] = path
    return dirs


def _hf_greedy(model_dir, prompt, n):
    """transformers' greedy ids and each chosen token's logprob (and the first step's top 5) on ``model_dir``, by a
    full forward per token: the expected output, computed without specjet."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, logprobs, first_top = list(prompt), [], None
    with torch.no_grad():
        for _ in range(n):
            row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            token = int(row.argmax())
            if first_top is None:
                values, indices = row.topk(5)
                first_top = dict(zip(indices.tolist(), values.tolist()))
            ids.append(token)
            logprobs.append(float(row[token]))
    return ids[len(prompt):], logprobs, first_top


QWEN3_PARAMS = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
QWEN3_PROMPTS = [IDS, IDS[:6], IDS[:6] * 3]  # the last repeats itself: n-grams to draft from on any CPU


def _run(path, alone=False, **engine_kw):
    with specjet.Engine(model_path=str(path), dtype="float32", max_total_tokens=1024, **engine_kw) as eng:
        kw = {"sampling_params": QWEN3_PARAMS, "return_logprob": True, "top_logprobs_num": 5}
        outs = ([eng.generate(input_ids=prompt, **kw) for prompt in QWEN3_PROMPTS] if alone
                else eng.generate(input_ids=QWEN3_PROMPTS, **kw))
        eng.check_kv_invariant()
        return outs, eng.worker.runner.config, eng.get_server_info(), eng.tokenizer


@pytest.mark.parametrize("kind, model", [("F32", "untied"), ("F16", "tied")])
def test_a_qwen3_gguf_gives_transformers_output_on_its_weights(tmp_path, qwen3_dirs, monkeypatch, kind, model):
    """transformers' GGUF reader maps no head_dim for Qwen3 (its config kept the class's 128, and loading a file of
    any other width failed on the attention weights' shapes). A float file dequantized by specjet computes what
    transformers computes on the same numbers: the same greedy ids, logprobs within float32 rounding."""
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(qwen3_dirs[model], tmp_path / f"tiny-qwen3-{kind}.gguf", "qwen3", kind=kind,
                      reference_dir=tmp_path / "reference")
    outs, config, _, tokenizer = _run(path, quantization=None)
    shape = (config.model_type, config.head_dim, config.qk_norm, config.tie_word_embeddings)
    assert shape == ("qwen3", 32, True, model == "tied")
    for prompt, out in zip(QWEN3_PROMPTS, outs):
        expected, logprobs, _ = _hf_greedy(tmp_path / "reference", prompt, QWEN3_PARAMS["max_new_tokens"])
        assert out["output_ids"] == expected
        ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3, (ours, logprobs)
    # The file's GPT-2 style BPE under its "qwen2" pre-tokenizer: Qwen's pattern keeps a run of newlines whole (the
    # default model's own tokenizer splits it), its chat markers are single tokens, and text decodes back.
    text = "<|im_start|>user\nHi, it's 2024.\n\nBye<|im_end|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert "\u010a\u010a" in tokenizer.convert_ids_to_tokens(ids)  # "\n\n" as one byte-level token
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and tokenizer.decode(ids) == text


def test_a_quantized_qwen3_gguf_runs_on_its_own_blocks_and_speculates_losslessly(tmp_path, qwen3_dirs, monkeypatch):
    """A Q8_0 Qwen3 file: dequantized (quantization=None) it gives transformers' ids on the dequantized weights;
    on its own blocks (quantization="gguf"; Qwen's q/k rows are not permuted, as for Qwen2) it follows that output
    within the blocks' rounding; NGRAM speculation on the blocks gives the plain blocks' ids."""
    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(qwen3_dirs["cyclic"], tmp_path / "tiny-qwen3-Q8_0.gguf", "qwen3", kind="Q8_0",
                      reference_dir=tmp_path / "reference")
    expected = [_hf_greedy(tmp_path / "reference", p, QWEN3_PARAMS["max_new_tokens"]) for p in QWEN3_PROMPTS]
    floats, *_ = _run(path, quantization=None)
    # dequantized, the file's numbers are the reference's (both gguf-py's and transformers' Q8_0 decoding are exact)
    assert [o["output_ids"] for o in floats] == [ids for ids, _, _ in expected]
    blocks, _, info, _ = _run(path, quantization="gguf")
    assert info["quantization"] == "gguf"
    for out, (ids, logprobs, first_top) in zip(blocks, expected):
        # As the blocks-against-floats test above: the first token's top 5 against transformers' (robust to a
        # near-tie's flip), then each token's logprob while the ids agree.
        top = {t: lp for lp, t, _ in out["meta_info"]["output_top_logprobs"][0]}
        shared = set(top) & set(first_top)
        assert len(shared) >= 3 and max(abs(top[t] - first_top[t]) for t in shared) < 0.3, (top, first_top)
        for (lp, token, _), want, want_lp in zip(out["meta_info"]["output_token_logprobs"], ids, logprobs):
            assert abs(lp - want_lp) < 0.3, (lp, want_lp)
            if token != want:
                break
    speculative, _, info, _ = _run(path, alone=True, quantization="gguf", speculative_algorithm="NGRAM")
    assert [o["output_ids"] for o in speculative] == [o["output_ids"] for o in blocks]
    assert info["stats"]["spec_phases"]["tree_nodes"] > 1, info["stats"]  # drafts were verified, not only roots


def test_a_gguf_whose_keys_and_values_differ_in_width_is_refused(tmp_path, qwen3_dirs, monkeypatch):
    """specjet's attention has one head width; a file stating another for the values is refused before converting."""
    import gguf

    from specjet.models.weights import resolve_model_path

    monkeypatch.setenv("SPECJET_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf.GGUFWriter, "add_value_length",
                        lambda writer, width: writer.add_uint32(f"{writer.arch}.attention.value_length", 2 * width))
    path = write_gguf(qwen3_dirs["untied"], tmp_path / "tiny-qwen3-kv.gguf", "qwen3", kind="F32")
    with pytest.raises(ValueError, match="keys 32 wide and values 64 wide"):
        resolve_model_path(path)
