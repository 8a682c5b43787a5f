"""quantization="gguf" on the real default model: the blocks it computes with are exactly the
weights the float32 conversion dequantizes (transformers' reading of the same GGUF), its logits stay
close to that float32 model's (the kernels quantize activations to int8 per 32-block, as llama.cpp
does: a stated tolerance, not equality), and its speculative greedy output (EAGLE, NGRAM) equals its plain
greedy output token for token, batched or alone; the KV invariant after every workload."""
from __future__ import annotations

import pytest
import torch

import specjet
from specjet.models.gguf_blocks import read_gguf_linears
from specjet.models.weights import default_gguf_path, load_state_dict
from model_harness import OneRequest, load_runner
from test_e2e_spec import QUESTIONS

pytestmark = pytest.mark.e2e
PARAMS = {"temperature": 0, "max_new_tokens": 48}


@pytest.fixture(scope="module")
def fp32_runner(default_model_dir):
    return load_runner(default_model_dir)


@pytest.fixture(scope="module")
def gguf_runner(default_model_dir):
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.runner import ModelRunner

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(default_model_dir))
    return ModelRunner(config, load_state_dict(default_model_dir), "auto", "cpu", 4096, 0.0, 1,
                       quantization="gguf", gguf_path=default_gguf_path())


def test_the_gguf_runner_holds_blocks_alone(gguf_runner):
    """Every projection and the head compute with the file's blocks; their float weights were never read (meta)."""
    from specjet.kernels.qgemm import QuantizedLinear
    from specjet.models.llama import Linear

    linears = [m for m in gguf_runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * gguf_runner.config.num_layers + 1
    assert all(isinstance(m.packed, QuantizedLinear) and m.weight_t.is_meta for m in linears)
    assert not gguf_runner.model.embed_tokens.weight.is_meta  # the embedding lookup stays float


def test_blocks_equal_the_float32_conversion(default_model_dir, fp32_runner):
    blocks = read_gguf_linears(default_gguf_path(), fp32_runner.config)
    sd = {k.removeprefix("model."): v for k, v in load_state_dict(default_model_dir).items()}
    assert torch.equal(blocks["lm_head"].dequantize(), sd["embed_tokens.weight"])  # tied: the Q8_0 embedding
    for i in (0, 17, fp32_runner.config.num_layers - 1):
        attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        expected = {
            attn + "qkv_proj": torch.cat([sd[attn + f"{n}_proj.weight"] for n in "qkv"]),
            attn + "o_proj": sd[attn + "o_proj.weight"],
            mlp + "gate_up_proj": torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]]),
            mlp + "down_proj": sd[mlp + "down_proj.weight"],
        }
        for name, weight in expected.items():
            assert torch.equal(blocks[name].dequantize(), weight), name


def test_logits_close_to_the_float32_model(default_model_dir, fp32_runner, gguf_runner):
    """Same weights, int8 activations: over every position of the chat prompts, each position's
    largest logit error under 25% of the float32 model's largest logit (3% typical: the median under
    5%, nine in ten under 10%; the worst measured ~17%), and the same top-1 token at >= 95% of
    positions (measured 96-99%: 96.3% under the bf16dp attention, 97.9% under the float32 lanes; prompt positions
    being the model's least certain)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    agree = total = 0
    errors = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        ids = tokenizer(text)["input_ids"]
        ref = OneRequest(fp32_runner).extend(ids).logits
        got = OneRequest(gguf_runner).extend(ids).logits
        errors.append(((got - ref).abs() / ref.abs().amax(-1, keepdim=True)).amax(-1))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
    errors = torch.cat(errors)
    summary = (float(errors.max()), float(errors.quantile(0.9)), float(errors.median()))
    assert summary[0] < 0.25 and summary[1] < 0.1 and summary[2] < 0.05, summary
    assert agree / total >= 0.95, agree / total


@pytest.fixture(scope="module")
def plain_gguf():
    with specjet.Engine(max_total_tokens=8192, quantization="gguf", disable_guided_drafting=True) as eng:
        prompts = [eng.apply_chat_template(q) for q in QUESTIONS]
        batched = [o["output_ids"] for o in eng.generate(prompts, PARAMS)]
        alone = [eng.generate(p, PARAMS)["output_ids"] for p in prompts[:2]]
        eng.check_kv_invariant()
    return prompts, batched, alone


def test_batched_equals_alone(plain_gguf):
    _, batched, alone = plain_gguf
    assert batched[:2] == alone


def test_a_batch_past_one_amx_tile_equals_alone():
    """17 requests decode in 17-row steps: on AMX the rows past a 16-row tile go to another kernel (the Q8_0
    head's 17th row once read activation codes no one wrote); every request equals itself alone."""
    params = {"temperature": 0, "max_new_tokens": 6}
    with specjet.Engine(max_total_tokens=8192, quantization="gguf", disable_guided_drafting=True,
                        disable_free_text_drafting=True) as eng:
        prompts = [eng.apply_chat_template(f"Name a colour that rhymes with the number {i}.") for i in range(17)]
        batched = [o["output_ids"] for o in eng.generate(prompts, params)]
        alone = [eng.generate(p, params)["output_ids"] for p in prompts]
        eng.check_kv_invariant()
    assert batched == alone


@pytest.mark.parametrize("algorithm", ["EAGLE", "NGRAM", "DFLASH"])
def test_speculative_equals_plain(plain_gguf, algorithm):
    from specjet.kernels.qgemm import QuantizedLinear
    from specjet.models.llama import Linear

    prompts, expected, expected_alone = plain_gguf
    with specjet.Engine(max_total_tokens=8192, quantization="gguf", speculative_algorithm=algorithm) as eng:
        outs = [o["output_ids"] for o in eng.generate(prompts, PARAMS)]
        batched = eng.get_server_info()["stats"]
        # Alone too: beside others, free text verifies its root alone with EAGLE and DFLASH on a quantized
        # CPU target (SpecConfig.free_text_draft_batch), so the drafts show only here.
        alone = [eng.generate(p, PARAMS)["output_ids"] for p in prompts[:2]]
        eng.check_kv_invariant()
        stats = eng.get_server_info()["stats"]
        drafter = eng.worker.speculator.drafter
        if algorithm in ("EAGLE", "DFLASH"):  # the draft shipped for the default model
            from specjet.models.dflash import default_dflash_path
            from specjet.models.eagle import default_eagle_path

            shipped = default_eagle_path() if algorithm == "EAGLE" else default_dflash_path()
            assert eng.worker.speculator.draft_model_dir == shipped
        learned = getattr(drafter, "learned", drafter)  # the learned drafter under the n-gram path
        draft = {"EAGLE": lambda: learned.head, "DFLASH": lambda: learned.draft}.get(algorithm)
        if draft is not None:  # a learned draft computes with the target's kind of weights
            linears = [m for m in draft().modules() if isinstance(m, Linear)]
            assert linears and all(isinstance(m.packed, QuantizedLinear) for m in linears)
            if algorithm == "DFLASH":  # the context K/V too: the quantized rows of each layer's k|v
                assert draft().context_kv and all(isinstance(op, QuantizedLinear) for op in draft().context_kv)
    assert outs == expected and alone == expected_alone
    assert stats["spec_accepted_tokens"] - batched["spec_accepted_tokens"] > stats["spec_verify_ct"] - batched["spec_verify_ct"]


def test_the_dflash_recipe_learns_the_gguf_target_the_engine_runs(default_model_dir, fp32_runner):
    """`python -m specjet.train dflash` without flags takes its features from the GGUF file's blocks (the
    engine's default weights): at every reply position the features' final hidden state, through that
    target's own head, gives the token a default engine's greedy reply wrote there. So the recipe's greedy
    replies, written by those blocks, are their own labels (``replies_written_by_the_feature_target``)."""
    from specjet.models.forward_batch import FeatureLayers
    from specjet.train.data import Sample, prompt_ids
    from specjet.train.dflash import build_parser
    from specjet.train.eagle import feature_target, replies_written_by_the_feature_target, target_quantization
    from specjet.train.features import target_features

    args = build_parser().parse_args([])
    assert target_quantization(args) == "gguf" and replies_written_by_the_feature_target(args)
    for other in (["--generate-quantization", "none"], ["--target-quantization", "none"]):  # another engine writes
        assert not replies_written_by_the_feature_target(build_parser().parse_args(other))
    runner, tag = feature_target(args, fp32_runner.config, load_state_dict(default_model_dir), fp32_runner)
    assert runner is not fp32_runner and runner.quantization == "gguf" and tag == "-gguf"
    # The features in float32 (the recipe keeps fp16): the same kernels as the engine's in this process, so their
    # logits are the engine's bit for bit (its reply tokens' logprobs, checked below) on every CPU. In fp16 the argmax
    # hangs on near ties: a position of this reply whose two best logits lie 0.135 apart with bf16dp attention lies
    # 0.0001 apart with the float32 lanes AVX2-only CPUs run, and fp16's rounding of the hidden state flips it there.
    with specjet.Engine(max_total_tokens=2048) as eng:  # the default engine: the same GGUF blocks
        prompt = prompt_ids(eng.tokenizer, [{"role": "user", "content": QUESTIONS[0]}])  # as the recipe prompts
        out = eng.generate(input_ids=prompt, sampling_params=dict(PARAMS, return_logprob=True))
        eng.check_kv_invariant()
    reply = out["output_ids"]
    engine_logprobs = torch.tensor([lp for lp, *_ in out["meta_info"]["output_token_logprobs"]])
    h = fp32_runner.config.hidden_size
    (features,) = target_features(runner, [Sample(prompt + reply, len(prompt), "test")], FeatureLayers((1, 8)),
                                  torch.float32)
    assert features.shape == (len(prompt) + len(reply), 3 * h)
    with torch.inference_mode():
        logits = runner.model.lm_head(features[len(prompt) - 1:-1, -h:]).float()
    assert logits.argmax(-1).tolist() == reply
    assert torch.equal(torch.log_softmax(logits, -1)[torch.arange(len(reply)), torch.tensor(reply)], engine_logprobs)
