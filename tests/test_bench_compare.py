"""`python -m bench.compare`: configuration parsing, the identity check, and the CLI end to end."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # bench/ is not installed; plain `pytest` does not put the root on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.compare import identity_check, main, parse_config, result_rows
from bench.decode_rate import Measurement
from specjet.kernels import bf16_gemm, qgemm
from specjet.kernels.cpu_features import describe_cpu
from specjet.models.runner import auto_dtype

# A decode rate is "n/a" where t_N did not exceed t_1 (a loaded machine can make a tiny run so).
NUM = r"(n/a|[\d.]+)"
ROW = re.compile(rf"^(\S+)\s+(\d+)\s+{NUM}\s+{NUM}\s+{NUM}\s+([\d.]+)\s+([\d.]+)\s+{NUM}\s+"
                 rf"{NUM}x\s+(reference|yes|n/a|NO \(\d+/\d+\))$", re.M)
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_compare(*flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "bench.compare", *flags], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def table_rows(stdout: str) -> dict[tuple[str, int], tuple]:
    return {(m[1], int(m[2])): m.groups()[2:] for m in ROW.finditer(stdout)}


def test_parse_config():
    # "none" is plain decoding, not the engine's default (which drafts under a grammar, and for a lone free-text
    # request on a CPU with the shipped DFlash draft); any other bare name is the command line's engine.
    assert parse_config("none").overrides == {"disable_guided_drafting": True} == parse_config("none:").overrides
    assert parse_config("default").overrides == {}
    assert parse_config("none:disable_overlap_schedule=true").overrides == {"disable_overlap_schedule": True,
                                                                            "disable_guided_drafting": True}
    c = parse_config("eagle-s2:speculative-algorithm=EAGLE,speculative_num_steps=2,disable_overlap_schedule=true")
    assert c.name == "eagle-s2"
    assert c.overrides == {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2,
                           "disable_overlap_schedule": True}
    assert parse_config("plain:speculative_algorithm=none").overrides == {"speculative_algorithm": None}
    with pytest.raises(ValueError, match="not an Engine argument"):
        parse_config("x:speculative_steps=2")
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        parse_config("x:speculative_algorithm")
    with pytest.raises(ValueError, match="no name"):
        parse_config(":page_size=4")


def test_identity_check_flags_the_request_that_differs():
    cells = {}
    for name in ("a", "b", "c"):
        cells[(name, 2)] = Measurement(name, "gsm8k", 2, 2, t_1=[0.1], t_n=[1.1], decode_tokens=[10],
                                       outputs=[[[1, 2, 3], [4, 5, 6]]])
    cells[("c", 2)].outputs = [[[1, 2, 3], [4, 9, 6]]]
    identity = identity_check(cells, "a")
    assert not identity["identical"] and identity["requests"] == 4
    assert identity["mismatches"] == [{"config": "c", "batch_size": 2, "run": 0, "request": 1,
                                       "first_differing_token": 1}]
    rows = {r["config"]: r for r in result_rows(cells, identity)}
    assert [rows[n]["identical"] for n in "abc"] == ["reference", "yes", "NO (1/2)"]
    assert rows["b"]["decode_tok_s"]["median"] == pytest.approx(10.0) and rows["b"]["speedup"] == pytest.approx(1)


def random_eagle_head(path: pathlib.Path, model_dir: pathlib.Path) -> pathlib.Path:
    """An untrained EAGLE head that fits the model: its drafts are mostly wrong, its outputs exact."""
    import torch
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.eagle import EagleDraftModel, save_eagle

    torch.manual_seed(0)
    head = EagleDraftModel(ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir)))
    head.reset_parameters(std=0.3)
    return save_eagle(head, path, dtype=torch.float32)


def test_compare_tiny_model_none_ngram_eagle(tiny_model_dir, tmp_path):
    result_file, chart = tmp_path / "compare.jsonl", tmp_path / "chart" / "compare.png"
    head = random_eagle_head(tmp_path / "head", tiny_model_dir)
    eagle = f"EAGLE:speculative_algorithm=EAGLE,speculative_draft_model_path={head},speculative_num_steps=2"
    # 64 tokens: with 16 a loaded host (CI's two workers) saw t_N <= t_1 more often, a row the report gives as "n/a"
    # (it still did once at 64, session 86): such a row must say so, and only such a row.
    proc = run_compare("--model-path", str(tiny_model_dir), "--configs", "none:", "NGRAM:speculative_algorithm=NGRAM",
                       eagle, "--batch-sizes", "1", "2", "--num-prompts", "2", "--max-new-tokens", "64",
                       "--repeats", "1", "--chart", str(chart), "--result-file", str(result_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    stdout = proc.stdout
    rows = table_rows(stdout)
    assert set(rows) == {(name, bs) for name in ("none", "NGRAM", "EAGLE") for bs in (1, 2)}
    for (name, _), (median, low, high, t_1, t_n, accept, speedup, identical) in rows.items():
        if median == "n/a":  # the host stalled the one-token run: no decode rate to give
            assert 0 < float(t_n) <= float(t_1)
        else:
            assert 0 < float(low) <= float(median) <= float(high) and 0 < float(t_1) < float(t_n)
        assert identical == ("reference" if name == "none" else "yes")
        assert (accept == "n/a") == (name == "none")
    assert "outputs identical: yes (NGRAM, EAGLE vs none: 8 requests compared)" in stdout
    dtype = str(auto_dtype("cpu")).removeprefix("torch.")  # no --dtype: the CPU's auto choice
    assert f"# config NGRAM: {dtype} on cpu, plain loop, speculative NGRAM num_draft_tokens=8" in stdout
    assert f"# config EAGLE: {dtype} on cpu, plain loop, speculative EAGLE num_steps=2 topk=4 num_draft_tokens=12" in stdout
    assert f"# machine: {describe_cpu()}; " in stdout
    # the kernels a figure was measured on, in its header
    assert f"; bf16 GEMM {bf16_gemm.default_isa()}, quantized GEMM {qgemm.default_isa()}\n" in stdout
    if HAS_MATPLOTLIB:
        assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "# chart: not written: --chart needs matplotlib" in stdout and not chart.exists()

    record = json.loads(result_file.read_text())
    assert record["benchmark"] == "compare" and record["machine"]["cores"] >= 1
    assert [c["name"] for c in record["configs"]] == ["none", "NGRAM", "EAGLE"]
    assert record["configs"][1]["engine_kwargs"] == {"model_path": str(tiny_model_dir),
                                                     "speculative_algorithm": "NGRAM"}
    assert record["outputs_identical"]["identical"] is True
    assert record["chart"] == (str(chart) if HAS_MATPLOTLIB else None)
    for r in record["results"]:
        assert r["requests"] == 2 and r["decode_tokens"] == [2 * 63]
        # The figure is recomputable from the raw timings.
        assert r["decode_tok_s"]["median"] == pytest.approx(126 / (r["t_n_s"][0] - r["t_1_s"][0]))
        if r["config"] != "none":
            assert r["verify_ct"][0] >= 1 and r["accept_length"] == r["accepted_tokens"][0] / r["verify_ct"][0]
            assert r["plain_iteration_ms"] is None
        else:  # a plain decode iteration holds its forward
            it = r["plain_iteration_ms"]
            assert 0 < it["forward_ms_median"] <= it["iteration_ms_median"]
    assert "# plain decoding: ms per decode iteration" in stdout


def test_compare_fails_loudly_when_outputs_differ(tiny_model_dir, tmp_path, capsys):
    # Two different models cannot give the same greedy tokens: the check must say so and fail.
    from conftest import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "other", tiny_model_dir, seed=1)
    result_file = tmp_path / "compare.jsonl"
    with pytest.raises(SystemExit, match="outputs differ"):
        main(["--model-path", str(tiny_model_dir), "--configs", "a", f"b:model_path={other}", "--batch-sizes", "2",
              "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", "--result-file", str(result_file)])
    stdout = capsys.readouterr().out
    assert "!!! OUTPUTS DIFFER: 2 of 2 requests are not identical to a's" in stdout
    assert table_rows(stdout)[("b", 2)][-1] == "NO (2/2)"
    assert json.loads(result_file.read_text())["outputs_identical"]["identical"] is False


def test_compare_samples_when_asked_and_compares_the_drawn_tokens(tiny_model_dir, tmp_path, capsys):
    """--temperature draws the tokens, request i with seed + i: a drafting configuration draws plain decoding's
    tokens (a token's coin is its seed's and position's), so sampled outputs are compared as greedy ones are; two
    different models fail the comparison; the report says how it drew."""
    from conftest import make_tiny_model_dir

    other = make_tiny_model_dir(tmp_path / "other", tiny_model_dir, seed=1)
    result_file = tmp_path / "compare.jsonl"
    sampled = ["--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "7"]
    main(["--model-path", str(tiny_model_dir), "--configs", "a", "b:speculative_algorithm=NGRAM", "--batch-sizes", "2",
          "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "2", *sampled, "--result-file", str(result_file)])
    stdout = capsys.readouterr().out
    assert "sampled (temperature=0.8, top_p=0.9, top_k=20, min_p=0.0, seed=7), EOS ignored" in stdout
    assert "outputs identical: yes (b vs a: 4 requests compared)" in stdout
    assert table_rows(stdout)[("b", 2)][-1] == "yes"
    with pytest.raises(SystemExit, match="outputs differ"):
        main(["--model-path", str(tiny_model_dir), "--configs", "a", f"b:model_path={other}", "--batch-sizes", "2",
              "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1", *sampled])
    record = json.loads(result_file.read_text())
    assert record["sampling"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.0, "seed": 7}
    with pytest.raises(SystemExit):
        main(["--temperature", "-1"])  # refused by the parser, before any engine


def test_sampled_system_draws_reproducibly_per_request(tiny_model_dir):
    from bench.decode_rate import SpecjetSystem
    from bench.decode_rate import Prompt

    system = SpecjetSystem("s", {"model_path": str(tiny_model_dir)}, {"temperature": 1.0, "seed": 3})
    try:
        batch = [Prompt([1, 2, 3, 4]), Prompt([1, 2, 3, 4])]
        first, again = system.generate(batch, 12), system.generate(batch, 12)
        ids = [o["output_ids"] for o in first]
        assert ids == [o["output_ids"] for o in again]  # seed + i for request i, every run
        assert ids[0] != ids[1]  # same prompt, different seeds: different draws (12 tokens of a random model)
        system.engine.check_kv_invariant()
    finally:
        system.close()


@pytest.mark.e2e
def test_compare_default_model(tmp_path):
    result_file = tmp_path / "compare.jsonl"
    proc = run_compare("--configs", "none", "NGRAM:speculative_algorithm=NGRAM", "--batch-sizes", "2",
                       "--num-prompts", "2", "--max-new-tokens", "16", "--repeats", "1", "--workload", "json",
                       "--result-file", str(result_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert set(table_rows(proc.stdout)) == {("none", 2), ("NGRAM", 2)}
    assert "outputs identical: yes" in proc.stdout
    record = json.loads(result_file.read_text())
    assert record["workload"] == "json" and record["prompt_tokens"]["count"] == 2


def test_history_tokens_put_the_same_long_context_before_every_prompt(tiny_model_dir):
    import argparse

    from transformers import AutoTokenizer

    from bench.common import GSM8K_TEST, JSONSCHEMA_DIR, gsm8k_questions
    from bench.compare import load_prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = dict(workload="gsm8k", num_prompts=2, data_path=str(GSM8K_TEST), json_path=str(JSONSCHEMA_DIR),
                json_constrained=False)
    short, _ = load_prompts(argparse.Namespace(history_tokens=0, **base), tokenizer)
    long, description = load_prompts(argparse.Namespace(history_tokens=600, **base), tokenizer)
    assert "earlier Q&A turns" in description
    for s, l, q in zip(short, long, gsm8k_questions(2, GSM8K_TEST)):
        assert len(l.ids) >= 600 + len(s.ids) - 20  # the history, then the same question
        alone = tokenizer.decode(s.ids)
        assert tokenizer.decode(l.ids).endswith(alone[alone.index(q["question"]):])
    shared = min(len(long[0].ids), len(long[1].ids)) - max(len(s.ids) for s in short)
    assert long[0].ids[:shared] == long[1].ids[:shared], "one shared context (the prefix cache holds it)"
    with pytest.raises(SystemExit):
        main(["--history-tokens", "-1"])  # refused by the parser, before any engine
    last = gsm8k_questions(None, GSM8K_TEST)[-1]["question"]
    assert last in tokenizer.decode(long[0].ids) and last not in tokenizer.decode(short[0].ids)


@pytest.mark.e2e
def test_stop_at_eos_ends_each_reply_where_the_model_does(tmp_path):
    """--stop-at-eos: the default model's GSM8K replies end at its EOS before N, as the same greedy tokens the
    EOS-ignoring run starts with; the report counts those replies' tokens and says how the replies ended."""
    from bench.common import chat_prompt, gsm8k_questions
    from bench.decode_rate import Prompt, SpecjetSystem

    n = 400
    stopping, running = SpecjetSystem("eos", {}, stop_at_eos=True), SpecjetSystem("n", {})
    try:
        tokenizer = stopping.engine.tokenizer
        prompts = [Prompt(tokenizer(chat_prompt(tokenizer, q["question"]))["input_ids"]) for q in gsm8k_questions(2)]
        ended, full = stopping.generate(prompts, n), running.generate(prompts, n)
        for short, whole in zip(ended, full):
            got = short["meta_info"]["completion_tokens"]
            assert short["meta_info"]["finish_reason"]["type"] == "stop" and 1 < got < n
            assert whole["meta_info"]["completion_tokens"] == n
            assert short["output_ids"] == whole["output_ids"][:len(short["output_ids"])]
        reply_tokens = sum(o["meta_info"]["completion_tokens"] - 1 for o in ended)
        for system in (stopping, running):
            system.engine.check_kv_invariant()
    finally:
        stopping.close()
        running.close()

    result_file = tmp_path / "compare.jsonl"
    proc = run_compare("--configs", "none", "--batch-sizes", "1", "--num-prompts", "2", "--max-new-tokens", str(n),
                       "--repeats", "1", "--stop-at-eos", "--result-file", str(result_file))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"N={n} new tokens per request, greedy, each reply ending at EOS or N; " in proc.stdout
    record = json.loads(result_file.read_text())
    assert record["stop_at_eos"] is True and record["results"][0]["decode_tokens"] == [reply_tokens]
