"""`python -m bench.json`: validity of hand-made outputs, the timing figures, the identity check, the
configuration axes, and the CLI end to end (a tiny model in process; the default model as a user runs it)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys

import jsonschema
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # bench/ is not installed; plain `pytest` does not put the root on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import JSONSCHEMA_DIR, jsonschema_prompts
from bench.json import (Cell, Config, check_output, completed_accept_length, identity_check, latency_figures,
                        load_validator, main, parse_args, validity)
from engine_defaults import default_model_dtype_name

# config, batch, valid, invalid, non-JSON, aborted, TTFT, TPOT, out tok/s, accept, acc. done, nodes, x uncon., identical
ROW = re.compile(r"^(\S+)\s+(\d+)\s+(n/a|-|[\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(n/a|[\d.]+)\s+(n/a|[\d.]+)\s+([\d.]+)\s+"
                 r"(-|[\d.]+)\s+(-|[\d.]+)\s+(-|[\d.]+)\s+(-|[\d.]+x)\s+(reference|yes|NO \(\d+/\d+\)|-)$", re.M)
RECIPES = json.loads((JSONSCHEMA_DIR / "001_Glaiveai2K.json").read_text())  # required: keywords, cuisine, ingredients


def table_rows(stdout: str) -> dict[tuple[str, int], tuple]:
    return {(m[1], int(m[2])): m.groups()[2:] for m in ROW.finditer(stdout)}


def output(text: str, finish: dict | None = None, ttft=0.1, e2e=1.0, tokens=10, ids=None) -> dict:
    return {"text": text, "output_ids": ids or [], "meta_info": {
        "finish_reason": finish or {"type": "stop"}, "ttft": ttft, "e2e_latency": e2e, "completion_tokens": tokens}}


# ---------------------------------------------------------------- validity
@pytest.mark.parametrize("out, status", [
    (output('{"keywords": ["pasta"], "cuisine": "Italian", "ingredients": ["tomato", "basil"]}'), "valid"),
    (output(' \n{"keywords": [], "cuisine": "", "ingredients": []}\n'), "valid"),  # whitespace around is JSON
    (output('{"keywords": ["pasta"], "cuisine": "Italian"}'), "invalid"),  # a required field missing
    (output('{"keywords": "pasta", "cuisine": "Italian", "ingredients": []}'), "invalid"),  # not an array
    (output('["pasta"]'), "invalid"),  # JSON, but not an object
    (output('{"keywords": ["pasta"], "cuisine": "Ital', {"type": "length", "length": 16}), "not_json"),  # cut off
    (output('```json\n{"keywords": [], "cuisine": "", "ingredients": []}\n```'), "not_json"),  # fenced
    (output("", {"type": "abort", "message": "grammar compilation failed"}, ttft=None, tokens=0), "aborted"),
    # Aborted is aborted even when the text so far happens to parse.
    (output('{"keywords": [], "cuisine": "", "ingredients": []}', {"type": "abort", "message": "x"}), "aborted"),
])
def test_check_output_statuses(out, status):
    got, why = check_output(out, load_validator(RECIPES))
    assert got == status
    assert (why is None) == (status == "valid")
    # The oracle: jsonschema itself, on what json.loads makes of the text.
    if status in ("valid", "invalid"):
        assert jsonschema.Draft202012Validator(RECIPES).is_valid(json.loads(out["text"])) == (status == "valid")


def test_validity_rate_leaves_aborted_out():
    figures = validity(["valid", "valid", "invalid", "not_json", "aborted"])
    assert figures == {"valid": 2, "invalid": 1, "not_json": 1, "aborted": 1, "requests": 5, "completed": 4,
                       "validity": 0.5}
    assert validity(["aborted"])["validity"] is None


def test_validator_follows_the_schemas_draft():
    # Draft 4: exclusiveMaximum is a boolean modifier of maximum; under 2020-12 it would be a number.
    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "maximum": 3,
              "exclusiveMaximum": True}
    validator = load_validator(json.dumps(schema))
    assert isinstance(validator, jsonschema.Draft4Validator)
    assert check_output(output("2"), validator)[0] == "valid"
    assert check_output(output("3"), validator)[0] == "invalid"


def test_every_dev_schema_loads():
    for entry in jsonschema_prompts():
        validator = load_validator(entry["schema"])
        type(validator).check_schema(validator.schema)


# ---------------------------------------------------------------- timing and identity
def test_latency_figures():
    outs = [output("", ttft=0.1, e2e=1.1, tokens=11),  # TPOT (1.1 - 0.1) / 10 = 0.1 s
            output("", ttft=0.3, e2e=0.3, tokens=1),  # one token: a TTFT, no TPOT
            output("", ttft=0.2, e2e=0.8, tokens=3),  # TPOT 0.3 s
            output("", {"type": "abort"}, ttft=None, e2e=0.05, tokens=0)]  # neither
    f = latency_figures(outs, wall_s=2.0)
    assert f["ttft_ms"] == pytest.approx(200) and f["tpot_ms"] == pytest.approx(200)
    assert f["completion_tokens"] == 15 and f["output_tok_s"] == pytest.approx(7.5)


def test_identity_check_flags_the_request_that_differs():
    def cell(name, bs, ids, constrained=True):
        return Cell(name, bs, constrained, outputs=[output("", ids=x) for x in ids])

    cells = [cell("none/on", 1, [[1, 2, 3], [4, 5]]), cell("unconstrained", 1, [[9], [9]], constrained=False),
             cell("EAGLE/on", 1, [[1, 2, 3], [4, 6, 7]]), cell("none/on", 2, [[1, 2], [4]]),
             cell("EAGLE/on", 2, [[1, 2], [4]])]
    identity = identity_check(cells, "none/on")
    assert not identity["identical"] and identity["requests"] == 4
    assert identity["mismatches"] == [{"config": "EAGLE/on", "batch_size": 1, "run": 0, "request": 1,
                                       "first_differing_token": 1}]
    assert identity["per_cell"] == {("EAGLE/on", 1): {"requests": 2, "differing": 1},
                                    ("EAGLE/on", 2): {"requests": 2, "differing": 0}}


def test_completed_accept_length_counts_finished_objects_only():
    """acc. done: tokens after the prefill's / verify forwards, pooled over the requests that
    finished their object; cut-off and non-speculative requests are left out."""
    outcomes = [{"finish": "stop", "completion_tokens": 11, "spec_verify_ct": 4},  # 10 tokens, 4 verifies
                {"finish": "stop", "completion_tokens": 7, "spec_verify_ct": 1},  # 6 tokens, 1 verify
                {"finish": "length", "completion_tokens": 65, "spec_verify_ct": 8}]  # cut: left out
    assert completed_accept_length(outcomes) == pytest.approx(16 / 5)
    assert completed_accept_length(outcomes[2:]) is None
    assert completed_accept_length([{"finish": "stop", "completion_tokens": 5, "spec_verify_ct": None}]) is None


# ---------------------------------------------------------------- configurations
def test_configurations_and_their_engine_arguments():
    base = {"dtype": "float32", "speculative_num_steps": 2}
    assert Config("none", "off").engine_kwargs(base) == {"dtype": "float32", "disable_guided_drafting": True,
                                                         "disable_overlap_schedule": True}
    assert Config("default", "on").engine_kwargs(base) == {"dtype": "float32", "disable_overlap_schedule": False}
    assert Config("EAGLE-GA", "on").engine_kwargs(base) == {
        "dtype": "float32", "speculative_num_steps": 2, "speculative_algorithm": "EAGLE",
        "speculative_grammar_aware": True, "disable_overlap_schedule": False}
    assert Config("EAGLE", "on").engine_kwargs(base)["speculative_grammar_aware"] is False
    args = parse_args([])
    assert (args.algorithms, args.overlap, args.batch_sizes) == (["none", "default", "EAGLE", "EAGLE-GA"], ["on", "off"],
                                                                  [1, 4])
    for axis in (["--speculative-algorithm", "EAGLE"], ["--disable-overlap-schedule"],
                 ["--speculative-grammar-aware", "true"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            parse_args(axis)


# ---------------------------------------------------------------- the CLI
def check_record(record: dict, rows: dict, n: int) -> None:
    """The figures, recomputed from the record's own per-request outcomes with json and jsonschema."""
    schemas = {e["name"]: json.loads(e["schema"]) for e in jsonschema_prompts(n)}
    assert record["benchmark"] == "json" and record["machine"]["cores"] >= 1 and record["date"]
    assert {(r["config"], r["batch_size"]) for r in record["results"]} == set(rows)
    for r in record["results"]:
        assert len(r["per_request"]) == r["requests"] == n
        valid = 0
        for req in r["per_request"]:
            try:
                ok = jsonschema.validators.validator_for(schemas[req["schema"]])(schemas[req["schema"]]).is_valid(
                    json.loads(req["text"]))
            except ValueError:
                ok = False
            assert ok == (req["status"] == "valid"), req
            valid += ok
        assert r["valid"] == valid and r["aborted"] == 0 and r["completed"] == n
        assert len(r["runs"]) == r["repeats"] == record["repeats"]
        assert r["output_tok_s"] == pytest.approx(statistics.median(f["completion_tokens"] / f["wall_s"] for f in r["runs"]))
        assert 1 <= r["completion_tokens"] <= n * record["max_new_tokens"]
        printed = rows[(r["config"], r["batch_size"])]
        if r["constrained"]:
            assert float(printed[0]) == pytest.approx(r["validity"], abs=5e-4)
        else:
            assert printed[0] == "-"
        assert float(printed[6]) == pytest.approx(r["output_tok_s"], abs=0.051)
        # nodes: the mean tree of the runs' verifies, for speculative rows (the engine's own count: test_spec_ngram)
        assert (r["tree_nodes"] is None) == (r["accept_length"] is None), r
        if r["tree_nodes"] is None:
            assert printed[9] == "-"
        else:
            assert r["tree_nodes"] >= 1 and float(printed[9]) == pytest.approx(r["tree_nodes"], abs=0.051)


def test_tiny_model_ngram_overlap_on_and_off(tiny_model_dir, tmp_path, capsys):
    result_file = tmp_path / "json.jsonl"
    record = main(["--model-path", str(tiny_model_dir), "--num-schemas", "2", "--max-new-tokens", "6",
                   "--algorithms", "none", "default", "NGRAM-GA", "--overlap", "on", "off", "--batch-sizes", "1", "2",
                   "--speculative-num-draft-tokens", "4", "--result-file", str(result_file)])
    stdout = capsys.readouterr().out
    rows = table_rows(stdout)
    configs = ["none/on", "none/off", "default/on", "default/off", "NGRAM-GA/on", "NGRAM-GA/off", "unconstrained"]
    assert set(rows) == {(c, bs) for c in configs for bs in (1, 2)}
    assert rows[("none/on", 1)][-1] == "reference" and rows[("unconstrained", 2)][-2:] == ("-", "-")
    assert rows[("NGRAM-GA/off", 2)][-1] == "yes" and rows[("NGRAM-GA/off", 2)][-2].endswith("x")
    assert ("outputs identical: yes (none/off, default/on, default/off, NGRAM-GA/on, NGRAM-GA/off vs none/on: "
            "20 requests compared)") in stdout
    assert re.search(r"^goal: no-spec constrained >= 0.95x unconstrained out tok/s at batch 4", stdout, re.M) is None
    assert json.loads(result_file.read_text()) == json.loads(json.dumps(record))
    check_record(record, rows, 2)
    # The unconstrained baseline is length-matched: each request decodes what it did under the grammar.
    results = {(r["config"], r["batch_size"]): r for r in record["results"]}
    for bs in (1, 2):
        assert [q["completion_tokens"] for q in results[("unconstrained", bs)]["per_request"]] == \
            [q["completion_tokens"] for q in results[("none/on", bs)]["per_request"]]
    engines = {c["name"]: c["engine"] for c in record["configs"]}
    assert engines["default/on"]["guided_drafting"] and not engines["none/on"]["guided_drafting"]
    assert engines["default/on"]["speculative"] is None
    ngram = engines["NGRAM-GA/off"]
    assert ngram["speculative"]["num_draft_tokens"] == 4 and ngram["speculative_grammar_aware"] is True
    assert ngram["overlap_schedule"] is False


def test_repeats_pair_each_constrained_run_with_an_unconstrained_one(tiny_model_dir, capsys):
    """--repeats 2: two timed runs per cell, each constrained baseline run followed by its
    length-matched unconstrained twin; x uncon. is the median of the per-run ratios, the goal line
    names them, and every repeat's outputs are checked against the reference's."""
    record = main(["--model-path", str(tiny_model_dir), "--num-schemas", "2", "--max-new-tokens", "5",
                   "--algorithms", "none", "NGRAM-GA", "--overlap", "on", "--batch-sizes", "4",
                   "--speculative-num-draft-tokens", "4", "--repeats", "2"])
    stdout = capsys.readouterr().out
    rows = table_rows(stdout)
    check_record(record, rows, 2)
    results = {r["config"]: r for r in record["results"]}
    base, uncon = results["none/on"], results["unconstrained"]
    assert record["repeats"] == 2 and all(len(r["runs"]) == 2 for r in record["results"])
    ratios = [c["output_tok_s"] / u["output_tok_s"] for c, u in zip(base["runs"], uncon["runs"])]
    assert base["vs_unconstrained_runs"] == pytest.approx(ratios)
    assert base["vs_unconstrained"] == pytest.approx(statistics.median(ratios))
    assert all(c["completion_tokens"] == u["completion_tokens"] for c, u in zip(base["runs"], uncon["runs"]))
    cpu = [u["cpu_ms_per_token"] / c["cpu_ms_per_token"] for c, u in zip(base["runs"], uncon["runs"])]
    assert all(f["cpu_ms_per_token"] > 0 for f in base["runs"] + uncon["runs"])
    assert base["vs_unconstrained_cpu"] == pytest.approx(statistics.median(cpu))
    goal = next(line for line in stdout.splitlines() if line.startswith("goal:"))
    assert f"none/on {base['vs_unconstrained']:.2f}x (median of {ratios[0]:.2f} {ratios[1]:.2f})" in goal
    assert f"by CPU time per token {base['vs_unconstrained_cpu']:.2f}x" in goal
    assert record["outputs_identical"]["requests"] == 4  # NGRAM-GA's 2 requests in each of 2 repeats
    assert "timings: medians of 2 runs" in stdout
    spec = results["NGRAM-GA/on"]
    if spec["accept_completed"] is not None:  # the tiny model may not finish any object in 5 tokens
        done = [q for q in spec["per_request"] if q["finish"] == "stop"]
        assert spec["accept_completed"] == pytest.approx(
            sum(q["completion_tokens"] - 1 for q in done) / sum(q["spec_verify_ct"] for q in done))


@pytest.mark.e2e
def test_default_model_none_and_eagle(tmp_path):
    result_file = tmp_path / "json.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "bench.json", "--num-schemas", "2", "--max-new-tokens", "12",
                           "--algorithms", "none", "EAGLE", "--overlap", "on", "--batch-sizes", "2",
                           "--result-file", str(result_file)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = table_rows(proc.stdout)
    assert set(rows) == {("none/on", 2), ("EAGLE/on", 2), ("unconstrained", 2)}
    assert rows[("EAGLE/on", 2)][-1] == "yes" and float(rows[("EAGLE/on", 2)][-5]) >= 1
    dtype = default_model_dtype_name()  # no --dtype, no --quantization: the auto choices
    assert f"# config EAGLE/on: {dtype} on cpu, speculative EAGLE" in proc.stdout
    assert "outputs identical: yes" in proc.stdout
    record = json.loads(result_file.read_text())
    check_record(record, rows, 2)
    eagle = next(r for r in record["results"] if r["config"] == "EAGLE/on")
    assert eagle["accept_length"] >= 1 and eagle["spec_verify_ct"] >= 1


def test_schema_indices_pick_entries(tiny_model_dir, capsys):
    """--schema-indices runs exactly those dev-set entries, in that order (e.g. a head's held-out
    schemas); an index past the end is refused."""
    record = main(["--model-path", str(tiny_model_dir), "--schema-indices", "3", "1", "--max-new-tokens", "2",
                   "--algorithms", "none", "--overlap", "on", "--batch-sizes", "1", "--skip-unconstrained"])
    names = [e["name"] for e in jsonschema_prompts()]
    assert [q["schema"] for q in record["results"][0]["per_request"]] == [names[3], names[1]]
    with pytest.raises(SystemExit, match="out of range"):
        main(["--model-path", str(tiny_model_dir), "--schema-indices", str(len(names)), "--algorithms", "none",
              "--overlap", "on", "--batch-sizes", "1"])
    capsys.readouterr()


def test_boolean_engine_flags_parse_and_refuse_bad_values(capsys):
    """--speculative-grammar-aware and --enable-deterministic-inference take true/false spellings and
    refuse anything else with a usage error."""
    import argparse

    from bench.common import add_engine_args, engine_kwargs

    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-grammar-aware", "off", "--enable-deterministic-inference", "True"])
    assert engine_kwargs(args) == {"speculative_grammar_aware": False, "enable_deterministic_inference": True}
    for flag in ("--speculative-grammar-aware", "--enable-deterministic-inference"):
        with pytest.raises(SystemExit):
            parser.parse_args([flag, "maybe"])
        assert "expected true or false, got 'maybe'" in capsys.readouterr().err


def test_the_kv_cache_dtype_flag_reaches_the_engine():
    """--kv-cache-dtype (bf16 is the default beside quantized weights; float32 compares against it) is an engine
    keyword; without it the engine's own default stands."""
    import argparse

    from bench.common import add_engine_args, engine_kwargs

    parser = add_engine_args(argparse.ArgumentParser())
    assert engine_kwargs(parser.parse_args(["--kv-cache-dtype", "float32"])) == {"kv_cache_dtype": "float32"}
    assert "kv_cache_dtype" not in engine_kwargs(parser.parse_args([]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])
