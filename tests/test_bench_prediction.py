"""bench.prediction decodes with no, an exact and an edited prediction end to end (tiny model), checks every
output against plain decoding's and records the run."""
from __future__ import annotations

import json

import pytest

from bench.prediction import edited, main, parse_args, workload
from specjet.kernels.cpu_features import describe_cpu


@pytest.mark.parametrize("workload", ["gsm8k", "json"])
def test_each_prediction_kind_against_plain(tiny_model_dir, tmp_path, capsys, workload):
    result_file = tmp_path / "prediction.jsonl"
    record = main(["--model-path", str(tiny_model_dir), "--workload", workload, "--num-prompts", "2",
                   "--max-new-tokens", "24", "--algorithms", "none", "NGRAM", "--max-total-tokens", "4096",
                   "--speculative-num-draft-tokens", "6", "--repeats", "2", "--result-file", str(result_file)])
    out = capsys.readouterr().out
    rows = {(r["algorithm"], r["prediction"]): r for r in record["rows"]}
    assert set(rows) == {(a, k) for a in ("none", "NGRAM") for k in ("none", "exact", "edited")}
    assert all(r["identical"] for r in rows.values()) and all(len(r["tok_s_rounds"]) == 2 for r in rows.values())
    assert all(r["tok_s"] == min(r["tok_s_rounds"]) for r in rows.values())  # the lower middle of two
    if workload == "gsm8k":  # the engine without speculation drafts for predictions and grammars alone
        assert rows[("none", "none")]["accept"] is None
    else:  # the schema's forced text
        assert rows[("none", "none")]["accept"] > 1.0
    if workload == "gsm8k":  # (under a schema the random model spells its JSON in other pieces than the text's)
        assert rows[("NGRAM", "exact")]["accept"] > max(3.0, rows[("NGRAM", "none")]["accept"])  # at most 6 a verify
        assert rows[("none", "exact")]["accept"] > 3.0
    assert "| NGRAM | exact |" in out and "| none | exact |" in out and out.startswith("# command: ")
    assert f"\n# machine: {describe_cpu()}; " in out
    assert json.loads(result_file.read_text().splitlines()[-1])["rows"] == json.loads(json.dumps(record["rows"]))


def test_an_edited_prediction_reverses_every_eighth_word():
    text = " ".join(f"w{i}x" for i in range(16))
    words = edited(text).split(" ")
    assert words[7] == "x7w" and words[15] == "x51w" and words[:7] == text.split(" ")[:7]


@pytest.mark.parametrize("flags", [["--num-prompts", "0"], ["--max-new-tokens", "-1"], ["--algorithms", "MEDUSA"],
                                   ["--repeats", "0"]])
def test_bad_arguments_are_refused(flags):
    with pytest.raises(SystemExit):
        parse_args(flags)


def test_gsm8k_questions_come_from_data_path(tiny_model_dir, tmp_path):
    """``--data-path`` names the GSM8K-style file (a lent GPU machine has no ../shared/data)."""
    from transformers import AutoTokenizer

    questions = ["How many legs have 3 spiders?", "What is 17 plus 25?"]
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "#### 0"}) + "\n" for q in questions))
    args = parse_args(["--num-prompts", "2", "--max-new-tokens", "5", "--data-path", str(path)])
    requests = workload(args, AutoTokenizer.from_pretrained(str(tiny_model_dir)))
    assert [q in prompt for q, (prompt, _) in zip(questions, requests)] == [True, True]
    assert all(params == {"temperature": 0, "max_new_tokens": 5} for _, params in requests)
    with pytest.raises(ValueError, match="only 2 items"):
        workload(parse_args(["--num-prompts", "3", "--data-path", str(path)]), None)
