"""bench.overlap runs both loops end to end (tiny model) and reports the compute side's waits."""
from __future__ import annotations

import json

from bench.overlap import main
from specjet.kernels.cpu_features import describe_cpu


def test_both_loops_report_waits_and_tpot(tiny_model_dir, tmp_path, capsys):
    result_file = tmp_path / "overlap.jsonl"
    record = main(["--model-path", str(tiny_model_dir), "--batch-sizes", "1", "2", "--max-new-tokens", "6",
                   "--repeats", "1", "--max-total-tokens", "4096", "--result-file", str(result_file)])
    out = capsys.readouterr().out
    rows = {(r["overlap"], r["batch_size"]): r for r in record["rows"]}
    assert set(rows) == {(True, 1), (True, 2), (False, 1), (False, 2)}
    for row in rows.values():
        assert row["iterations"] > 0 and row["compute_ms_median"] > 0
        assert 0 <= row["wait_fraction_median"] < 1 and row["tpot_ms"] > 0 and row["output_tok_s"] > 0
    assert "| 2 | overlap |" in out and "| 2 | plain |" in out
    assert "bs=1: TPOT overlap/plain = " in out
    assert out.startswith("# command: ") and f"\n# machine: {describe_cpu()}; " in out
    assert record["machine"]["cpu_description"] == describe_cpu()
    assert json.loads(result_file.read_text().splitlines()[-1])["rows"] == json.loads(json.dumps(record["rows"]))

