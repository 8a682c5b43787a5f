"""`python -m bench.latency` end to end, as a user runs it: a subprocess from the repository root."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

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
    # The tiny random-weight model keeps this fast; N is large enough that t_N - t_1 stands clear of noise.
    result_file = tmp_path / "latency.jsonl"
    flags = ["--model-path", str(tiny_model_dir), "--batch-sizes", "1", "2", "--max-new-tokens", "24",
             "--repeats", "1", "--num-prompts", "2", "--result-file", str(result_file)]
    stdout = run_bench(*flags)

    assert "# command: python -m bench.latency --model-path" in stdout
    assert re.search(r"^# machine: .+cores usable, torch threads \d+", stdout, re.M)
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
    assert record["benchmark"] == "latency" and record["args"]["max_new_tokens"] == 24
    assert record["machine"]["cores"] >= 1 and record["machine"]["torch"]
    assert record["specjet_dtype"] == record["hf_dtype"] == "float32"
    assert {(r["system"], r["batch_size"]) for r in record["results"]} == set(rows)
    for r in record["results"]:
        assert r["requests"] == 2
        assert r["decode_tok_s"]["median"] > 0
        # The figure is recomputable from the raw timings: requests * (N-1) / (t_N - t_1).
        assert r["decode_tok_s"]["median"] == pytest.approx(2 * 23 / (r["t_n_s"][0] - r["t_1_s"][0]))
        assert r["decode_tok_s"]["median"] == pytest.approx(rows[(r["system"], r["batch_size"])][0], abs=0.06)
    assert record["specjet_over_hf"]["1"] > 0 and record["scaling"]["specjet"]["2/1"] > 0


@pytest.mark.e2e
def test_latency_default_model_specjet_only(tmp_path):
    result_file = tmp_path / "latency.jsonl"
    stdout = run_bench("--skip-hf", "--batch-sizes", "1", "2", "--max-new-tokens", "8", "--repeats", "1",
                       "--num-prompts", "2", "--max-running-requests", "4", "--result-file", str(result_file))
    rows = table_rows(stdout)
    assert set(rows) == {("specjet", 1), ("specjet", 2)}
    assert all(values[0] > 0 for values in rows.values())
    assert "specjet/HF" not in stdout
    record = json.loads(result_file.read_text())
    assert record["hf_dtype"] is None and record["args"]["skip_hf"] is True
    assert record["args"]["max_running_requests"] == 4
