"""The EAGLE training pipeline on a tiny random target: data, features, a short training run that
lowers the loss and resumes exactly, the accept-length evaluation against a direct oracle, and
the CLI end to end."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import SHARED_DATA
from model_harness import load_runner
from specjet.models.eagle import EagleDraftModel, load_eagle, read_eagle_config, save_eagle
from specjet.train import data as D
from specjet.train import trainer as T
from specjet.train.evaluate import chain_draft, evaluate, format_report
from specjet.train.features import Sequence, extract_features, load_sequences, target_features

GSM8K_TRAIN = SHARED_DATA / "gsm8k" / "train.jsonl"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def runner(tiny_model_dir):
    runner = load_runner(tiny_model_dir, tokens=1024)
    runner.model.requires_grad_(False)
    runner.model.lm_head.packed = None  # as the pipeline does: the full-vocab head must take gradients
    return runner


@pytest.fixture(scope="module")
def samples(tokenizer):
    records = D.read_jsonl(GSM8K_TRAIN)[:6]
    return D.gsm8k_human_samples(tokenizer, records, max_len=96)


@pytest.fixture(scope="module")
def sequences(runner, samples, tmp_path_factory):
    out = tmp_path_factory.mktemp("features")
    extract_features(runner, samples, out, "features", shard_size=4, max_tokens=200)
    return load_sequences(out)


def test_samples_are_chat_formatted_prompt_then_reply(tokenizer, samples):
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    records = D.read_jsonl(GSM8K_TRAIN)[:6]
    assert samples[0].ids[:samples[0].prompt_len] == D.prompt_ids(tokenizer, D.gsm8k_question(records[0]))
    assert max(len(s.ids) for s in samples) == 96  # cut at max_len
    for s in D.gsm8k_human_samples(tokenizer, records, max_len=10_000):
        assert s.ids[-1] == eos and eos not in s.ids[s.prompt_len:-1]
    for s, r in zip(D.gsm8k_human_samples(tokenizer, records, max_len=10_000), records):
        # The reference solution verbatim, calculator notes included (the few-shot target writes them too).
        assert tokenizer.decode(s.ids[s.prompt_len:-1]) == r["answer"]


def test_features_are_the_runners_final_hidden_state(runner, samples, sequences):
    assert len(sequences) == len(samples)  # two shards, read back in order
    for seq, s in zip(sequences, samples):
        assert seq.ids.tolist() == s.ids and seq.prompt_len == s.prompt_len and seq.source == "gsm8k_human"
    alone = target_features(runner, [samples[5]])[0]  # the same sample in a forward of its own
    torch.testing.assert_close(sequences[5].features.float(), alone.float(), rtol=2e-3, atol=2e-3)
    assert sequences[5].features.dtype == torch.float16


def test_unchunked_projections_give_the_same_features(tiny_model_dir, runner, samples, sequences):
    """The feature runner's projections as one call whatever the rows (``unchunk_projections``, the trainers'
    float32 features): every float projection's plan reaches any row count, the C++ stack is rebuilt with them,
    and a pack's features are those of the chunked runner."""
    from specjet.kernels.linear import PackedLinear
    from specjet.models.llama import UNCHUNKED_ROWS

    whole = load_runner(tiny_model_dir, tokens=1024)
    stack_before = whole.model.layer_stack
    whole.model.unchunk_projections()
    plans = [m.packed for m in whole.model.modules() if isinstance(getattr(m, "packed", None), PackedLinear)]
    assert plans and all(p.max_rows == UNCHUNKED_ROWS for p in plans)
    assert (whole.model.layer_stack is None) == (stack_before is None)
    assert whole.model.layer_stack is not stack_before or stack_before is None
    together = target_features(whole, samples)
    for seq, f in zip(sequences, together):
        torch.testing.assert_close(f.float(), seq.features.float(), rtol=2e-3, atol=2e-3)


def test_few_shot_form_is_the_benchmarks(tokenizer):
    from bench import gsm8k as bench_gsm8k

    shots, held, rest = D.gsm8k_split(GSM8K_TRAIN, 30, seed=0)
    records = D.read_jsonl(GSM8K_TRAIN)
    assert shots == records[:D.NUM_SHOTS]
    questions = {r["question"] for r in held} | {r["question"] for r in rest}
    assert not questions & {r["question"] for r in shots}  # the shots are never a training or eval question
    assert not {r["question"] for r in held} & {r["question"] for r in rest}
    assert len(held) + len(rest) == len(records) - D.NUM_SHOTS
    q = rest[0]["question"]
    assert D.few_shot_prompt(shots, q) == bench_gsm8k.few_shot_prompt(records[:bench_gsm8k.parse_args([]).num_shots], q)
    assert D.FEW_SHOT_STOP == bench_gsm8k.STOP


def test_shared_prefix_runs_once_with_the_same_features(runner):
    """Samples with a long common prefix (few-shot prompts): prefix once, then the rest against it."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 1000, (40,), generator=g).tolist()
    samples = [D.Sample(ids=prefix + torch.randint(0, 1000, (n,), generator=g).tolist(), prompt_len=40, source="x")
               for n in (5, 9, 1)]
    together = target_features(runner, samples)
    for s, f in zip(samples, together):
        alone = target_features(runner, [s])[0]
        assert f.shape == alone.shape == (len(s.ids), runner.config.hidden_size)
        torch.testing.assert_close(f.float(), alone.float(), rtol=2e-3, atol=2e-3)


def test_crop_prompt_keeps_the_reply():
    seq = Sequence(ids=torch.arange(10), features=torch.arange(10.0)[:, None], prompt_len=7, source="x",
                   target_reply=True)
    cropped = T.crop_prompt(seq, 3)
    assert cropped.ids.tolist() == list(range(4, 10)) and cropped.prompt_len == 3
    assert cropped.source == "x" and cropped.target_reply  # still the target's own reply: its own labels
    assert cropped.features[:, 0].tolist() == list(range(4, 10))
    assert T.crop_prompt(seq, 7) is seq


def test_target_replies_are_the_greedy_samples_of_the_feature_target():
    from specjet.train.features import mark_target_replies

    samples = [D.Sample([1, 2, 3], 1, "a", greedy=True), D.Sample([1, 2, 4], 1, "b", greedy=False)]
    seqs = [Sequence(torch.tensor(s.ids), torch.zeros(3, 1), 1, s.source) for s in samples]
    mark_target_replies(seqs, samples, written_by_the_target=True)
    assert [s.target_reply for s in seqs] == [True, False]
    mark_target_replies(seqs, samples, written_by_the_target=False)  # another engine wrote them: none is its own
    assert [s.target_reply for s in seqs] == [False, False]
    with pytest.raises(ValueError, match="not these samples"):
        mark_target_replies(seqs, samples[:1], written_by_the_target=True)


def test_hot_token_ids_are_the_most_frequent(samples):
    hot = D.hot_token_ids(samples, 64, 49152, always=(2,))
    assert len(hot) == 64 and torch.equal(hot, hot.sort().values) and 2 in hot.tolist()
    counts = torch.bincount(torch.tensor([t for s in samples for t in s.ids]), minlength=49152)
    others = torch.ones(49152, dtype=torch.bool)
    others[hot] = False
    assert counts[hot].min() >= counts[others].max()
    assert 0.0 < D.coverage(samples, hot) <= 1.0
    assert len(D.hot_token_ids(samples[:1], 5000, 49152)) == 5000  # padded when the data has fewer ids


def new_head(runner, hot=None) -> EagleDraftModel:
    torch.manual_seed(0)
    return EagleDraftModel(runner.config, hot_token_ids=hot).bind_target(runner.model)


def test_training_lowers_the_loss_and_resumes_exactly(runner, samples, sequences, tmp_path, monkeypatch):
    hot = D.hot_token_ids(samples, 512, runner.config.vocab_size, always=(2,))
    cfg = T.TrainConfig(steps=60, batch_tokens=256, lr=3e-3, warmup_steps=3, checkpoint_every=20, seed=0)
    head = new_head(runner, hot)
    result = T.train(head, sequences, cfg, tmp_path / "a.pt")
    first, final = result["first"], result["final"]
    assert final["loss"] < 0.9 * first["loss"]
    assert final["regression"] < first["regression"] and final["cross_entropy"] < first["cross_entropy"]

    # Interrupt a second run after 33 steps; it restarts from its step-20 checkpoint and ends identical.
    calls = {"n": 0}
    real_batch_loss = T.batch_loss

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 34:
            raise KeyboardInterrupt
        return real_batch_loss(*args, **kwargs)

    monkeypatch.setattr(T, "batch_loss", flaky)
    with pytest.raises(KeyboardInterrupt):
        T.train(new_head(runner, hot), sequences, cfg, tmp_path / "b.pt")
    monkeypatch.setattr(T, "batch_loss", real_batch_loss)
    resumed = new_head(runner, hot)
    # Resumed with another checkpoint interval (it changes no result: the run goes on, where it restarted at 0).
    import dataclasses

    assert T.train(resumed, sequences, dataclasses.replace(cfg, checkpoint_every=7), tmp_path / "b.pt")["steps"] == 60
    for (name, p), q in zip(head.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)

    with pytest.raises(ValueError, match="another training config"):
        T.train(new_head(runner, hot), sequences, T.TrainConfig(steps=30), tmp_path / "b.pt")

    save_eagle(head, tmp_path / "head", training=result)
    loaded = load_eagle(tmp_path / "head", runner.config).bind_target(runner.model)
    assert torch.equal(loaded.hot_token_ids, hot)
    assert read_eagle_config(tmp_path / "head")["training"]["steps"] == 60


def test_unrolled_training_scores_every_draft_depth(runner, samples, sequences):
    """Training-time test: with depths=3 the loss covers draft steps 1 and 2 (run on the head's own
    hidden states) as well as teacher forcing, and training improves the deep steps' agreement."""
    hot = D.hot_token_ids(samples, 512, runner.config.vocab_size, always=(2,))
    cfg = T.TrainConfig(steps=60, batch_tokens=256, lr=3e-3, warmup_steps=3, seed=0, depths=3)
    head = new_head(runner, hot)
    batch = T.collate(sequences[:2])
    one = T.batch_loss(head, *batch, T.TrainConfig(noise=0.0))
    three = T.batch_loss(head, *batch, T.TrainConfig(noise=0.0, depths=3))
    assert set(three) == set(one) | {"top1_d1", "top1_d2"}
    assert torch.equal(three["regression"], one["regression"])  # depth 0 is teacher forcing either way
    assert not torch.isclose(three["loss"], one["loss"])  # the deeper depths enter the total

    result = T.train(head, sequences, cfg, None)
    first, final = result["first"], result["final"]
    assert final["loss"] < 0.9 * first["loss"]
    assert final["top1_d2"] > first["top1_d2"]


def test_chain_draft_matches_a_direct_oracle(runner, sequences):
    """Accepted drafts from the batched paged evaluation == drafting each position one at a time
    with the training forward over the explicit draft sequence."""
    hot = torch.arange(0, runner.config.vocab_size, 3)
    head = new_head(runner, hot)
    head.reset_parameters(std=0.1)
    seq = sequences[0]
    steps = 3
    result = chain_draft(head, seq, steps)
    ids, feats = seq.ids, seq.features.float()
    n, first = len(ids), seq.prompt_len - 1
    expected_drafts, expected_accepted = [], []
    with torch.no_grad():
        for t in range(first, n - 2):
            tokens, features, drafts = list(ids[1:t + 2]), list(feats[:t + 1]), []
            for _ in range(steps):
                hidden = head.forward_train(torch.tensor(tokens)[None], torch.stack(features)[None])[0, -1]
                drafts.append(int(head.hot_to_full(head.logits(hidden).argmax(-1))))
                tokens.append(drafts[-1])
                features.append(hidden)
            truth = ids[t + 2:t + 2 + steps].tolist()
            accepted = 0
            while accepted < min(steps, len(truth)) and drafts[accepted] == truth[accepted]:
                accepted += 1
            expected_drafts.append(drafts)
            expected_accepted.append(accepted)
    assert result["drafts"].tolist() == expected_drafts
    assert result["accepted"].tolist() == expected_accepted


def test_evaluate_report(runner, sequences):
    report = evaluate(new_head(runner, torch.arange(0, runner.config.vocab_size, 2)), sequences[:3], max_steps=4)
    assert set(report) == {"gsm8k_human", "all"}
    r = report["all"]
    lengths = [r["accept_length"][k] for k in range(1, 5)]
    assert all(1.0 <= a <= 1 + k for a, k in zip(lengths, range(1, 5))) and lengths == sorted(lengths)
    assert 0.0 <= r["top1"] <= r["top4"] <= 1.0
    assert "k=4" in format_report(report)


def test_cli_end_to_end(tiny_model_dir, tmp_path):
    """Generation through the Engine, features, training, evaluation and the saved head."""
    from specjet.train.__main__ import main

    schemas = tmp_path / "schemas"
    schemas.mkdir()
    index = json.loads((SHARED_DATA / "jsonschema" / "index.json").read_text())
    index["schemas"] = index["schemas"][:2]
    for entry in index["schemas"]:
        (schemas / entry["file"]).write_text((SHARED_DATA / "jsonschema" / entry["file"]).read_text())
    (schemas / "index.json").write_text(json.dumps(index))
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"text": "The quick brown fox jumps over the lazy dog."}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": "Hello!"}]}) + "\n")
    out = tmp_path / "head"
    argv = ["eagle", "--model-path", str(tiny_model_dir), "--work-dir", str(tmp_path / "work"), "--out", str(out),
            "--jsonschema-dir", str(schemas), "--json-eval-every", "2", "--json-per-schema", "2",
            "--extra-jsonl", str(extra), "--num-target-replies", "3", "--num-human-replies", "4", "--num-eval", "2",
            "--num-few-shot-replies", "2", "--num-few-shot-eval", "1", "--max-new-tokens", "12",
            "--json-max-new-tokens", "12", "--steps", "6", "--batch-tokens", "512", "--hot-vocab", "300",
            "--warmup-steps", "2", "--eval-steps", "3", "--threads", "1", "--feature-dtype", "bfloat16"]
    main(argv)
    meta = read_eagle_config(out)
    # An EAGLE-3 head (trained on fused features, loads as one) on --feature-layers' default for a 2-layer target
    assert meta["feature_layers"] == [0]
    # Features from a bf16 target, cached apart from fp32 ones.
    assert "--feature-dtype bfloat16" in meta["training"]["command"]
    assert [p.name.endswith("-L0-bfloat16") for p in (tmp_path / "work" / "features").iterdir()] == [True, True]
    training = meta["training"]
    assert meta["hot_vocab_size"] == 300 and training["steps"] == 6
    assert training["data"]["train"]["gsm8k_human"]["sequences"] == 4
    assert training["data"]["train"]["gsm8k_target"]["sequences"] == 3
    assert training["data"]["train"]["json_target"]["sequences"] == 2  # schema 1 kept, two instances
    assert training["data"]["train"]["extra"]["sequences"] == 2
    assert training["data"]["train"]["gsm8k_fewshot_target"]["sequences"] == 2
    assert training["data"]["eval"]["gsm8k"]["sequences"] == 2
    assert training["data"]["eval"]["gsm8k_fewshot"]["sequences"] == 1
    assert set(training["data"]["eval"]) == {"gsm8k", "gsm8k_fewshot", "json"}
    assert set(training["eval"]["all"]["accept_length"]) == {"1", "2", "3"}
    load_eagle(out, load_runner(tiny_model_dir, tokens=64).config)
    # The replies are cached per dtype of the engine that wrote them ("auto" as resolved, also in the command),
    # and the command records the thread count.
    import specjet

    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=256) as eng:  # what "auto" is to an engine
        dtype = eng.get_server_info()["dtype"]
    assert all(p.name.endswith(f"-{dtype}.jsonl") for p in (tmp_path / "work" / "data").glob("*.jsonl"))
    assert f"--generate-dtype {dtype}" in training["command"] and "--threads 1" in training["command"]
    # A rerun finds everything cached: no generation, no features, the training checkpoint reused.
    main(argv)
    assert read_eagle_config(out)["training"]["timings_s"]["features"] < 1.0


def test_a_work_dir_or_an_out_that_holds_something_else_is_refused(tiny_model_dir, default_model_dir, tmp_path,
                                                                    capsys):
    """Another model in a folder of the same name found the first one's cached replies, features and finished
    checkpoint, and saved the first one's head; --out naming the target's own folder wrote the head over it. Both
    are refused before any work, naming the folder."""
    from conftest import make_tiny_model_dir
    from specjet.train.__main__ import main
    from specjet.train.eagle import claim_work_dir, default_work_dir, target_fingerprint

    other = make_tiny_model_dir(tmp_path / "elsewhere" / tiny_model_dir.name, default_model_dir, seed=7)
    assert other.name == tiny_model_dir.name and target_fingerprint(other) != target_fingerprint(tiny_model_dir)
    assert default_work_dir("eagle", other) != default_work_dir("eagle", tiny_model_dir)
    work = tmp_path / "work"
    claim_work_dir(work, target_fingerprint(tiny_model_dir), tiny_model_dir)
    claim_work_dir(work, target_fingerprint(tiny_model_dir), tiny_model_dir)  # the same target: taken again
    with pytest.raises(SystemExit) as exit_:
        main(["eagle", "--model-path", str(other), "--work-dir", str(work), "--threads", "1"])
    assert exit_.value.code == 2 and "holds the data of another target" in capsys.readouterr().err
    config_before = (other / "config.json").read_text()
    with pytest.raises(SystemExit) as exit_:
        main(["eagle", "--model-path", str(other), "--work-dir", str(tmp_path / "work2"), "--out", str(other),
              "--threads", "1"])
    assert exit_.value.code == 2 and "holds no specjet-eagle draft: not overwritten" in capsys.readouterr().err
    assert (other / "config.json").read_text() == config_before


@pytest.mark.parametrize("job", ["eagle", "dflash"])
@pytest.mark.parametrize("flag,value", [
    ("--num-eval", "0"), ("--hot-vocab", "-1"), ("--checkpoint-every", "0"), ("--steps", "0"), ("--lr", "-1"),
    ("--lr", "nan"), ("--threads", "0"), ("--max-len", "1"), ("--max-running-requests", "0"),
    ("--json-eval-every", "0"), ("--gsm8k", "/nonexistent.jsonl"), ("--warmup-steps", "-1")])
def test_a_trainer_flag_out_of_range_is_refused_when_read(job, flag, value, capsys):
    """Each was taken and failed after the data and feature stages (a division by zero, a reshape, the optimizer),
    crashed after training (--num-eval 0), or wrote a head quietly wrong (--steps 0, --hot-vocab -1)."""
    from specjet.train.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([job, flag, value])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--decay", "0"), ("--blocks-per-seq", "0"), ("--block-size", "1"),
                                        ("--num-layers", "0"), ("--window", "0")])
def test_a_dflash_flag_out_of_range_is_refused_when_read(flag, value, capsys):
    from specjet.train.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["dflash", flag, value])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_the_target_to_learn_follows_the_engines_default_weights(tiny_model_dir, runner):
    from argparse import Namespace

    from specjet.models.weights import default_gguf_path, load_state_dict
    from specjet.train.eagle import feature_target, target_quantization

    def args(model_path, choice, feature_dtype="float32", feature_gemm="float32"):
        return Namespace(model_path=model_path, target_quantization=choice, feature_dtype=feature_dtype,
                         feature_gemm=feature_gemm)

    # auto: the GGUF blocks for a GGUF model (the engine's CPU default), float weights for a directory
    assert target_quantization(args(None, "auto")) == "gguf"
    assert target_quantization(args(str(default_gguf_path()), "auto")) == "gguf"
    assert target_quantization(args(str(tiny_model_dir), "auto")) is None
    assert target_quantization(args(None, "none")) is None
    # a float target's features come from the fp32 runner itself, or from one in --feature-dtype
    same, tag = feature_target(args(str(tiny_model_dir), "auto"), runner.config, None, runner)
    assert same is runner and tag == ""
    other, tag = feature_target(args(str(tiny_model_dir), "none", "bfloat16"), runner.config,
                                load_state_dict(tiny_model_dir), runner)
    assert other.dtype == torch.bfloat16 and other.quantization is None and tag == "-bfloat16"
    # --feature-gemm auto: the layers as three bf16 tile products where the CPU has tiles (a tag of their own)
    from specjet.kernels.bf16_gemm import Bf16x3Linear, bf16x3_available

    fresh = load_runner(tiny_model_dir, tokens=256)
    same, tag = feature_target(args(str(tiny_model_dir), "auto", feature_gemm="auto"), fresh.config, None, fresh)
    tiles = bf16x3_available()
    assert same is fresh and tag == ("-bf16x3" if tiles else "")
    assert isinstance(fresh.model.layers[0].mlp.down_proj.packed, Bf16x3Linear) == tiles


@pytest.mark.e2e
def test_replies_can_be_written_by_the_gguf_engine_for_a_float_target(tmp_path):
    """--generate-quantization gguf: the GGUF file's blocks write the replies (cached apart), while the
    target the draft learns stays --target-quantization's; the replies are that engine's greedy ones."""
    from transformers import AutoTokenizer

    import specjet
    from specjet.models.weights import resolve_model_path
    from specjet.train.eagle import build_parser, collect_samples, generate_quantization, target_quantization

    flags = ["--num-target-replies", "2", "--num-few-shot-replies", "0", "--num-human-replies", "0",
             "--num-eval", "1", "--num-few-shot-eval", "0", "--json-per-schema", "0", "--max-new-tokens", "8",
             "--target-quantization", "none"]
    args = build_parser().parse_args(flags + ["--generate-quantization", "gguf"])
    assert generate_quantization(args) == "gguf" and target_quantization(args) is None
    assert generate_quantization(build_parser().parse_args(flags)) is None  # "target": the target's weights
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(None)))
    train, evaluation = collect_samples(args, tokenizer, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "gsm8k_fewshot_eval-s0-n8-gguf.jsonl", "gsm8k_fewshot_train-s0-n8-gguf.jsonl",
        "gsm8k_target_eval-s0-n8-gguf.jsonl", "gsm8k_target_train-s0-n8-gguf.jsonl"]
    samples = [s for s in train + evaluation if s.source in ("gsm8k", "gsm8k_target")]
    assert len(samples) == 3
    with specjet.Engine(quantization="gguf", max_total_tokens=4096) as eng:
        outs = eng.generate(input_ids=[s.ids[:s.prompt_len] for s in samples],
                            sampling_params={"temperature": 0, "max_new_tokens": 8})
        eng.check_kv_invariant()
    assert [s.ids[s.prompt_len:] for s in samples] == [o["output_ids"] for o in outs]


@pytest.mark.parametrize("job", ["eagle", "dflash"])
def test_data_that_is_not_there_is_named_before_anything_runs(job, tmp_path, capsys):
    """From an installed copy the default data folder (a checkout's ../shared/data) is not there: the missing file
    or folder is named at once, not a traceback after the engine loaded; ``--jsonschema-dir ''`` skips the JSON
    data as its help says (it read ./index.json)."""
    from specjet.train import dflash, eagle
    from specjet.train.eagle import cli_main, missing_data

    build_parser = {"eagle": eagle.build_parser, "dflash": dflash.build_parser}[job]
    train = tmp_path / "train.jsonl"
    train.write_text("{}\n")
    no_index = ["--gsm8k", str(train), "--jsonschema-dir", str(tmp_path)]
    for argv, words in ((["--gsm8k", str(tmp_path / "none.jsonl")], "--gsm8k: no such file"),
                        (no_index, "--jsonschema-dir: no index.json")):
        with pytest.raises(SystemExit) as exit_:
            cli_main(job, build_parser, lambda args: pytest.fail("ran"), argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
    args = build_parser().parse_args(["--gsm8k", str(train), "--jsonschema-dir", ""])
    assert args.jsonschema_dir is None and missing_data(args) is None


def test_an_interrupted_trainer_says_how_to_resume(capsys):
    """Ctrl-C printed a KeyboardInterrupt traceback; the command now ends with 130 and says the rerun resumes."""
    from specjet.train.eagle import build_parser, cli_main

    def interrupted(args):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as exit_:
        cli_main("eagle", build_parser, interrupted, ["--threads", "1"])
    assert exit_.value.code == 130 and "the same command resumes" in capsys.readouterr().err


@pytest.mark.parametrize("job", ["eagle", "dflash"])
def test_no_training_data_is_said_before_anything_runs(job, capsys):
    """Every count at 0 and no --extra-jsonl: a ZeroDivisionError (EAGLE) or a torch.cat error (DFlash) after the
    data and feature stages; now the parser's error."""
    from specjet.train import dflash, eagle
    from specjet.train.eagle import cli_main

    build_parser = {"eagle": eagle.build_parser, "dflash": dflash.build_parser}[job]
    argv = ["--num-target-replies", "0", "--num-few-shot-replies", "0", "--num-human-replies", "0",
            "--jsonschema-dir", ""]
    with pytest.raises(SystemExit) as exit_:
        cli_main(job, build_parser, lambda args: pytest.fail("ran"), argv)
    assert exit_.value.code == 2 and "no training data" in capsys.readouterr().err


@pytest.mark.parametrize("job,flags", [("eagle", ["--feature-layers", "5"]), ("eagle", ["--feature-layers", "1", "0"]),
                                       ("dflash", ["--target-layers", "0", "5"]), ("dflash", ["--mask-token-id", "-1"])])
def test_a_layer_list_the_target_lacks_is_refused_before_the_data(tiny_model_dir, tmp_path, capsys, job, flags):
    """The README's promise: layer lists and the mask token id are checked once the model is read. They were checked
    when the draft was made, after the data and feature stages (the EAGLE default, layers 1 and 14, on a target of
    fewer layers: a traceback after them)."""
    from specjet.train.__main__ import main

    argv = [job, "--model-path", str(tiny_model_dir), "--work-dir", str(tmp_path / "work"), "--out",
            str(tmp_path / "out"), "--threads", "1", *flags]
    if job == "dflash":
        argv += ["--data-dir", str(tmp_path / "data")]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "must " in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.jsonl")) and not (tmp_path / "work" / "features").exists()


def test_a_run_under_another_thread_count_is_another_run():
    """The head's bits depend on the torch thread count (on the default model's sizes: one step's sums split by
    thread), which its config's command records: a run resumed (or a finished one taken again) under another
    --threads went on from the other count's checkpoint. The count names the checkpoint as the other settings do."""
    from specjet.train.eagle import eagle_run_key

    cfg = T.TrainConfig(steps=10)
    assert eagle_run_key(cfg, 300, 2) == eagle_run_key(T.TrainConfig(steps=10, checkpoint_every=3), 300, 2)
    assert eagle_run_key(cfg, 300, 1) != eagle_run_key(cfg, 300, 2)
    assert eagle_run_key(cfg, 300, 2) != eagle_run_key(T.TrainConfig(steps=11), 300, 2)


def test_the_default_feature_layers_fit_any_depth():
    """``--feature-layers`` by default: the default model's 1 and 14 of 30 (the shipped head's), a low and a middle
    layer of any other depth, never a layer the target lacks (a fixed 1 14 refused every model under 15 layers)."""
    from specjet.models.eagle import check_layer_ids
    from specjet.train.eagle import default_feature_layers

    assert default_feature_layers(30) == [1, 14]
    assert default_feature_layers(16) == [1, 7]
    assert default_feature_layers(4) == [1]
    assert default_feature_layers(3) == [0, 1]
    assert default_feature_layers(2) == [0]
    assert default_feature_layers(1) == []  # the final hidden state alone
    for layers in range(1, 80):  # raises for an id out of range or out of order
        check_layer_ids(default_feature_layers(layers), layers, "--feature-layers")
