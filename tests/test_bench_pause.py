"""bench.pause runs short requests after pauses on both loops end to end (tiny model) and records them."""
from __future__ import annotations

import json

import pytest

from bench.pause import main, parse_args
from specjet.kernels.cpu_features import describe_cpu


def test_both_loops_after_each_pause(tiny_model_dir, tmp_path, capsys):
    result_file = tmp_path / "pause.jsonl"
    record = main(["--model-path", str(tiny_model_dir), "--pauses", "0", "60", "--requests", "3",
                   "--max-new-tokens", "2", "--json-constrained", "--max-total-tokens", "4096",
                   "--result-file", str(result_file)])
    out = capsys.readouterr().out
    rows = {(r["loop"], r["pause_ms"]): r for r in record["rows"]}
    assert set(rows) == {("plain", 0.0), ("plain", 60.0), ("overlap", 0.0), ("overlap", 60.0)}
    for row in rows.values():
        assert row["requests"] == 3 and len(row["wall_ms"]) == 3 and len(row["cpu_ms"]) == 3
        assert 0 < row["wall_ms_p25"] <= row["wall_ms_median"] <= row["wall_ms_p75"]
        assert all(c >= 0 for c in row["cpu_ms"])
    assert record["engines"]["plain"]["overlap_schedule"] is False
    assert record["engines"]["overlap"]["overlap_schedule"] is True
    assert "| plain | 60 |" in out and "| overlap | 0 |" in out
    assert out.startswith("# command: ") and f"\n# machine: {describe_cpu()}; " in out
    assert json.loads(result_file.read_text().splitlines()[-1])["rows"] == json.loads(json.dumps(record["rows"]))


@pytest.mark.parametrize("flags", [["--requests", "1"], ["--pauses", "-5"], ["--max-new-tokens", "0"]])
def test_bad_arguments_are_refused(flags):
    with pytest.raises(SystemExit):
        parse_args(flags)
