"""`python -m bench.latency` end to end, as a user runs it: a subprocess from the repository root."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from specjet.kernels.cpu_features import describe_cpu, has_native_bf16
from specjet.models.runner import auto_dtype

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(specjet|HF)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", re.M)


def run_bench(*flags: str, timeout: float = 240) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "bench.latency", *flags], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def table_rows(stdout: str) -> dict[tuple[str, int], list[float]]:
    return {(m[1], int(m[2])): [float(x) for x in m.groups()[2:]] for m in ROW.finditer(stdout)}


def test_latency_against_hf_writes_table_and_record(tiny_model_dir, tmp_path):
    # The tiny random-weight model keeps this fast; N is large enough that t_N - t_1 stands clear of noise (24 was not:
    # on a loaded host a hiccup in the 1-token pass once made t_N <= t_1 for specjet at batch 1, a row the report lacks).
    result_file = tmp_path / "latency.jsonl"
    flags = ["--model-path", str(tiny_model_dir), "--batch-sizes", "1", "2", "--max-new-tokens", "96",
             "--repeats", "1", "--num-prompts", "2", "--result-file", str(result_file)]
    stdout = run_bench(*flags)

    assert "# command: python -m bench.latency --model-path" in stdout
    assert re.search(r"^# machine: .+cores usable, torch threads \d+", stdout, re.M)
    assert f"# machine: {describe_cpu()}; " in stdout  # the CPU's model and its bf16 capability
    rows = table_rows(stdout)
    assert set(rows) == {("specjet", 1), ("HF", 1), ("specjet", 2), ("HF", 2)}
    for median, low, high, t_1, t_n in rows.values():
        assert 0 < low <= median <= high
        assert 0 < t_1 < t_n
    assert re.search(r"^specjet/HF: bs1 [\d.]+x, bs2 [\d.]+x$", stdout, re.M)
    assert re.search(r"^scaling specjet: bs2/bs1 [\d.]+x$", stdout, re.M)

    records = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert len(records) == 1
    record = records[0]
    assert record["benchmark"] == "latency" and record["args"]["max_new_tokens"] == 96
    assert record["machine"]["cores"] >= 1 and record["machine"]["torch"]
    # The default dtype follows the CPU (auto: bf16 with native bf16 instructions, else fp32).
    assert record["specjet_dtype"] == record["hf_dtype"] == str(auto_dtype("cpu")).removeprefix("torch.")
    # The tiny model's safetensors are float weights, and the header says which weights each system computes with.
    assert record["specjet_quantization"] is None
    assert f"specjet {record['specjet_dtype']} with float weights, HF {record['hf_dtype']} with float weights" in stdout
    assert record["machine"]["cpu_native_bf16"] == has_native_bf16()
    assert {(r["system"], r["batch_size"]) for r in record["results"]} == set(rows)
    for r in record["results"]:
        assert r["requests"] == 2 and r["workload"] == "gsm8k"
        assert r["decode_tok_s"]["median"] > 0
        # The figure is recomputable from the raw timings: requests * (N-1) / (t_N - t_1).
        assert r["decode_tok_s"]["median"] == pytest.approx(2 * 95 / (r["t_n_s"][0] - r["t_1_s"][0]))
        assert r["decode_tok_s"]["median"] == pytest.approx(rows[(r["system"], r["batch_size"])][0], abs=0.06)
    figures = record["figures"]["gsm8k"]
    assert figures["specjet_over_hf"]["1"] > 0 and figures["scaling"]["specjet"]["2/1"] > 0
    assert record["outputs_identical"] is None and "speedup" not in figures


@pytest.mark.e2e
def test_latency_default_model_specjet_only(tmp_path):
    result_file = tmp_path / "latency.jsonl"
    # enough tokens that t_N - t_1 stands clear of the noise of a loaded machine
    stdout = run_bench("--skip-hf", "--batch-sizes", "1", "2", "--max-new-tokens", "32", "--repeats", "1",
                       "--num-prompts", "2", "--max-running-requests", "4", "--result-file", str(result_file))
    rows = table_rows(stdout)
    assert set(rows) == {("specjet", 1), ("specjet", 2)}
    assert all(values[0] > 0 for values in rows.values())
    assert "specjet/HF" not in stdout
    record = json.loads(result_file.read_text())
    assert record["hf_dtype"] is None and record["args"]["skip_hf"] is True
    assert record["args"]["max_running_requests"] == 4


# ---------------------------------------------------------------- speculative decoding
SPEC_ROW = re.compile(r"^(specjet\+NGRAM|specjet)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                      r"(?:\s+([\d.]+))?$", re.M)
SWEEP_ROW = re.compile(r"^(plain|draft=\d+ breadth=\d+)\s+([\d.]+|-)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x$",
                       re.M)


@pytest.fixture(scope="module")
def cyclic_model_dir(tmp_path_factory, default_model_dir):
    """Smaller weights than the shared tiny model: its greedy output falls into short cycles, so NGRAM
    drafts are often right and the accept length is well above 1 (as in tests/test_spec_eagle.py)."""
    from conftest import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-cyclic"), default_model_dir, weight_std=0.05)


def sections(stdout: str) -> dict[str, str]:
    """The report's `## <workload>: ...` sections by workload name."""
    parts = re.split(r"^## ", stdout, flags=re.M)[1:]
    return {part.split(":", 1)[0]: part for part in parts}


def test_latency_speculative_ngram_plain_vs_spec(cyclic_model_dir, tmp_path):
    result_file = tmp_path / "latency.jsonl"
    # With drafts this tiny model accepts, 24 new tokens took so few verifies that a loaded host's hiccup in
    # the 1-token pass made t_N <= t_1 (no figure, "n/a", a row the report then lacks); 64 did too at batch 2 while
    # the other xdist worker ran an engine on two threads (tests/test_engine_on_a_team.py).
    new_tokens = 256
    stdout = run_bench("--model-path", str(cyclic_model_dir), "--speculative-algorithm", "NGRAM", "--skip-hf",
                       "--batch-sizes", "1", "2", "--max-new-tokens", str(new_tokens), "--repeats", "1", "--num-prompts", "2",
                       "--max-total-tokens", "4096", "--result-file", str(result_file))

    assert re.search(r"^# speculative: specjet\+NGRAM = NGRAM num_draft_tokens=8 max_bfs_breadth=4", stdout, re.M)
    by_workload = sections(stdout)
    assert set(by_workload) == {"gsm8k", "json"}  # both workloads by default when speculating
    assert "decoded without the grammar" in by_workload["json"]
    for text in by_workload.values():
        rows = {(m[1], int(m[2])): m for m in SPEC_ROW.finditer(text)}
        assert set(rows) == {("specjet", 1), ("specjet+NGRAM", 1), ("specjet", 2), ("specjet+NGRAM", 2)}
        for (system, _), m in rows.items():
            assert float(m[3]) > 0
            assert (m[8] is None) == (system == "specjet")  # the accept column: speculative rows only
        assert all(float(rows[("specjet+NGRAM", bs)][8]) > 1.5 for bs in (1, 2))  # drafts were accepted
        assert re.search(r"^speed-up specjet\+NGRAM/specjet: bs1 [\d.]+x, bs2 [\d.]+x$", text, re.M)
        assert re.search(r"^accept length specjet\+NGRAM: bs1 [\d.]+, bs2 [\d.]+$", text, re.M)
        assert "HF" not in text
    assert re.search(r"^outputs identical: yes \(specjet\+NGRAM vs specjet, greedy: 8 requests in 4 N-token passes\)$",
                     stdout, re.M)

    record = json.loads(result_file.read_text())
    assert record["speculative"]["algorithm"] == "NGRAM" and record["speculative_system"] == "specjet+NGRAM"
    assert record["outputs_identical"]["identical"] is True and record["outputs_identical"]["requests"] == 8
    assert record["hf_dtype"] is None and record["args"]["speculative_algorithm"] == "NGRAM"
    for workload in ("gsm8k", "json"):
        figures = record["figures"][workload]
        assert set(figures["speedup"]) == set(figures["accept_length"]) == {"1", "2"}
        assert figures["accept_length"]["1"] > 1.5
    spec = [r for r in record["results"] if r["system"] == "specjet+NGRAM"]
    assert len(spec) == 4
    for r in spec:
        # Every token after a request's first is committed by a verify forward of the N-token pass.
        assert r["accepted_tokens"] == r["decode_tokens"] == [2 * (new_tokens - 1)]
        assert r["accept_length"] == pytest.approx(r["accepted_tokens"][0] / r["verify_ct"][0])
        assert sum(int(k) * v for k, v in r["accept_histogram"].items()) == 2 * (new_tokens - 1)
        assert sum(r["accept_histogram"].values()) == r["verify_ct"][0]
        # Where an iteration's time went (n-gram drafting is host work, the verify a forward).
        assert set(r["spec_phases_ms"]) == {"grammar_ms", "draft_ms", "verify_ms", "draft_extend_ms"}
        assert r["spec_phases_ms"]["verify_ms"] > 0
    assert all("accept_length" not in r and "spec_phases_ms" not in r
               for r in record["results"] if r["system"] == "specjet")


def test_latency_sweep_ngram_two_configs(cyclic_model_dir, tmp_path):
    result_file = tmp_path / "sweep.jsonl"
    stdout = run_bench("--model-path", str(cyclic_model_dir), "--speculative-algorithm", "NGRAM", "--sweep",
                       "--sweep-num-draft-tokens", "4", "8", "--sweep-ngram-breadth", "4", "--workload", "json",
                       # enough tokens that t_N - t_1 stands clear of the noise of a loaded machine
                       "--max-new-tokens", "192", "--repeats", "1", "--num-prompts", "2", "--max-total-tokens", "4096",
                       "--result-file", str(result_file))

    assert re.search(r"^# sweep: NGRAM, 2 configurations of num_draft_tokens \{4, 8\} x ngram_breadth \{4\}", stdout,
                     re.M)
    table = sections(stdout)["json"]
    assert "batch size 1" in table.splitlines()[0]  # the sweep's default batch size
    rows = [m.groups() for m in SWEEP_ROW.finditer(table)]
    assert len(rows) == 3 and {r[0] for r in rows} == {"plain", "draft=4 breadth=4", "draft=8 breadth=4"}, table
    rates = [float(r[2]) for r in rows]
    assert rates == sorted(rates, reverse=True) and rates[-1] > 0  # sorted by decode tok/s
    for name, accept, _, _, _, speedup in rows:
        assert (accept == "-") == (name == "plain")
        assert name != "plain" or speedup == "1.00"
        assert name == "plain" or float(accept) > 1.5
    assert re.search(r"^## ranking at batch size 1: geometric mean of the speed-ups over json$", stdout, re.M)
    assert re.search(r"^outputs identical: yes \(every configuration vs plain, greedy: 4 requests in 2 N-token "
                     r"passes\)$", stdout, re.M)

    record = json.loads(result_file.read_text())
    assert record["benchmark"] == "latency-sweep" and record["outputs_identical"]["identical"] is True
    assert [c["label"] for c in record["sweep"]["configs"]] == ["draft=4 breadth=4", "draft=8 breadth=4"]
    assert record["sweep"]["configs"][1]["effective"]["num_draft_tokens"] == 8
    assert {(r["system"], r["batch_size"]) for r in record["results"]} == {
        ("plain", 1), ("draft=4 breadth=4", 1), ("draft=8 breadth=4", 1)}
    assert sorted(record["figures"]["1"]["ranking"]) == ["draft=4 breadth=4", "draft=8 breadth=4"]


def test_sweep_grid_skips_impossible_trees():
    from bench.latency_common import SWEEP_DEFAULTS
    from bench.spec_sweep import eagle_max_nodes, grid, label

    configs, skipped = grid("EAGLE", SWEEP_DEFAULTS["EAGLE"])
    assert len(configs) + len(skipped) == 3 * 2 * 4
    for kw in configs + skipped:
        possible = kw["speculative_num_draft_tokens"] <= eagle_max_nodes(kw["speculative_num_steps"],
                                                                          kw["speculative_eagle_topk"])
        assert possible == (kw in configs)
    assert sorted(map(label, configs)) == sorted(
        ["steps=1 topk=4 draft=4", "steps=3 topk=1 draft=4", "steps=5 topk=1 draft=4"]
        + [f"steps={s} topk=4 draft={d}" for s in (3, 5) for d in (4, 8, 12, 16)])
    configs, _ = grid("EAGLE", dict(SWEEP_DEFAULTS["EAGLE"], num_steps=[4], topk=[4], num_draft_tokens=[12],
                                    hybrid_ngram_tokens=[0, 4]))
    assert list(map(label, configs)) == ["steps=4 topk=4 draft=12", "steps=4 topk=4 draft=12 ngram=4"]
    assert configs[1]["speculative_hybrid_ngram_tokens"] == 4
    configs, skipped = grid("NGRAM", SWEEP_DEFAULTS["NGRAM"])
    assert len(configs) == 6 and not skipped
    assert label(configs[0]) == "draft=4 breadth=1"


def test_flags_and_output_comparison():
    from bench.common import engine_kwargs, without_speculation
    from bench.decode_rate import Measurement
    from bench.latency_common import identity_check, identity_line, parse_args

    args = parse_args(["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
                       "--speculative-draft-model-path", "/x", "--dtype", "bfloat16"])
    assert args.workload == ["gsm8k", "json"] and args.batch_sizes == [1, 8]
    kwargs = engine_kwargs(args)
    assert kwargs == {"dtype": "bfloat16", "speculative_algorithm": "EAGLE", "speculative_num_steps": 3,
                      "speculative_draft_model_path": "/x"}  # unset flags are left to the Engine
    assert without_speculation(kwargs) == {"dtype": "bfloat16", "disable_guided_drafting": True}
    assert parse_args([]).workload == ["gsm8k"] and "speculative_algorithm" not in engine_kwargs(parse_args([]))
    assert engine_kwargs(parse_args(["--quantization", "none"]))["quantization"] is None  # float weights
    assert engine_kwargs(parse_args(["--quantization", "auto"]))["quantization"] == "auto"
    assert "quantization" not in engine_kwargs(parse_args([]))  # the engine's default (auto)
    assert parse_args(["--sweep", "--speculative-algorithm", "NGRAM"]).batch_sizes == [1]
    for bad in (["--sweep"], ["--sweep", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3"],
                ["--sweep", "--speculative-algorithm", "NGRAM", "--sweep-topk", "2"], ["--sweep-topk", "2"],
                ["--sweep", "--speculative-algorithm", "EAGLE", "--sweep-hybrid-ngram-tokens", "-1"],
                ["--sweep", "--speculative-algorithm", "DFLASH"]):  # no grid for DFLASH: a one-line error
        with pytest.raises(SystemExit):
            parse_args(bad)

    def runs(system: str, *outputs) -> Measurement:
        return Measurement(system, "gsm8k", 1, 2, outputs=list(outputs))

    plain = [[1, 2, 3], [4, 5, 6]]
    hf = runs("HF")  # no output ids: left out of the check
    same = identity_check([runs("specjet", plain), runs("specjet+EAGLE", plain), hf], "specjet")
    assert same["identical"] and same["requests"] == 2 and identity_line(same, "x").startswith("outputs identical: yes")
    diff = identity_check([runs("specjet", plain), runs("specjet+EAGLE", [[1, 2, 3], [4, 9, 6]]), hf], "specjet")
    assert not diff["identical"] and diff["mismatches"][0]["request"] == 1
    assert diff["mismatches"][0]["first_differing_token"] == 1
    assert identity_line(diff, "x").startswith("outputs identical: NO (x: 1 of 2 requests differ")
