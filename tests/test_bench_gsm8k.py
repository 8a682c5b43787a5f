"""`python -m bench.gsm8k`: the answer parser on real GSM8K solutions and on model outputs, the prompt
format, and the CLI end to end (a subprocess from the repository root, as a user runs it)."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from decimal import Decimal

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # bench/ is not installed; plain `pytest` does not put the root on the path
    sys.path.insert(0, str(REPO_ROOT))

from bench.answer_parsing import gold_answer, last_number, number_str
from bench.gsm8k import build_prompts, chat_messages, few_shot_prompt, score

GSM8K = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
FIGURE_LINES = {
    "Accuracy": re.compile(r"^Accuracy: (\d\.\d{3})$", re.M),
    "Invalid": re.compile(r"^Invalid: (\d\.\d{3})$", re.M),
    "Latency": re.compile(r"^Latency: (\d+\.\d{3}) s$", re.M),
    "Output throughput": re.compile(r"^Output throughput: (\d+\.\d{3}) token/s$", re.M),
}
ACCEPT_LINE = re.compile(r"^Accept length: (\d+\.\d{3})$", re.M)


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (GSM8K / name).read_text(encoding="utf-8").splitlines() if line.strip()]


# ---------------------------------------------------------------- the answer parser
@pytest.mark.parametrize("split, index, gold", [
    ("test", 0, 18),  # "...$<<9*2=18>>18 every day at the farmer's market.\n#### 18"
    ("test", 2, 70000),  # "...200,000-130,000=$<<200000-130000=70000>>70,000\n#### 70000"
    ("test", 146, 2125),  # "#### 2,125"
    ("test", 201, 114200),  # "...=$<<109200+5000=114200>>114,200\n#### 114,200"
    ("test", 489, -10),  # "... is -10 degrees Fahrenheit.\n#### -10"
    ("train", 345, 1080),  # "#### 1,080"
    ("train", 644, 109200000),  # "#### 109,200,000"
])
def test_gold_answer_of_real_solutions(split, index, gold):
    solution = read_jsonl(f"{split}.jsonl")[index]["answer"]
    assert gold_answer(solution) == gold
    # A model that copies the reference solution's style is scored by its last number: the same.
    assert last_number(solution) == gold


def test_every_gold_answer_parses_as_an_integer():
    for split in ("test", "train"):
        for item in read_jsonl(f"{split}.jsonl"):
            tail = item["answer"].rsplit("####", 1)[1].strip()
            assert gold_answer(item["answer"]) == int(tail.replace(",", "")), tail


@pytest.mark.parametrize("output, expected", [
    (" Janet has 16 - 3 - 4 = 9 eggs left.\nShe makes 9 * 2 = $18.\n#### 18", "18"),
    ("The answer is $1,234.", "1234"),
    ("So the total is 5.0 dollars.", "5"),
    ("She pays $12.50 in total.", "12.5"),
    ("The temperature drops to -7 degrees.", "-7"),
    ("He loses -$5.", "-5"),
    ("16-3-4=9", "9"),  # minus signs between numbers are operators, not signs
    ("The answer is: **42**", "42"),
    ("<<48/2=24>>24 clips in May, so 48+24 = <<48+24=72>>72\n#### 72", "72"),
    ("Between 3,4 and 5", "5"),  # a comma not followed by a group of three ends the number
    ("It costs 1,000,000.25 dollars", "1000000.25"),
    ("There are 50% more", "50"),
    ("I do not know.", None),
    ("", None),
])
def test_last_number_of_model_outputs(output, expected):
    assert number_str(last_number(output)) == expected


def test_decimal_and_comma_forms_compare_equal():
    assert last_number("5.0") == last_number("5") == Decimal(5)
    assert last_number("$1,234") == last_number("1234.00") == 1234
    with pytest.raises(ValueError):
        gold_answer("no hashes here 12")


def test_score_counts_correct_and_invalid():
    questions = read_jsonl("test.jsonl")[:4]  # golds 18, 3, 70000, 540
    outputs = [{"text": " ... #### 18"}, {"text": " 3.0 bolts"}, {"text": "no idea"}, {"text": "$541"}]
    figures = score(questions, outputs)
    assert figures["golds"] == ["18", "3", "70000", "540"]
    assert figures["predictions"] == ["18", "3", None, "541"]
    assert (figures["correct"], figures["invalid_count"]) == (2, 1)
    assert figures["accuracy"] == 0.5 and figures["invalid"] == 0.25
    # An aborted request's partial text is no answer, even where its last number is the gold one.
    outputs[0]["meta_info"] = {"finish_reason": {"type": "abort", "message": "KV pool exhausted"}}
    figures = score(questions, outputs)
    assert figures["predictions"] == [None, "3", None, "541"]
    assert (figures["correct"], figures["invalid_count"]) == (1, 2)


# ---------------------------------------------------------------- prompts
def test_few_shot_prompt_is_sglangs_format():
    shots = read_jsonl("train.jsonl")[:2]
    question = read_jsonl("test.jsonl")[0]["question"]
    prompt = few_shot_prompt(shots, question)
    expected = ("Question: " + shots[0]["question"] + "\nAnswer: " + shots[0]["answer"] + "\n\n"
                + "Question: " + shots[1]["question"] + "\nAnswer: " + shots[1]["answer"] + "\n\n"
                + "Question: " + question + "\nAnswer:")
    assert prompt == expected
    assert few_shot_prompt([], question) == f"Question: {question}\nAnswer:"


def test_chat_prompts_put_shots_in_turns():
    shots = read_jsonl("train.jsonl")[:1]
    questions = read_jsonl("test.jsonl")[:2]
    assert [m["role"] for m in chat_messages(shots, "q?")] == ["user", "assistant", "user"]
    seen = []
    prompts = build_prompts(shots, questions, lambda messages: seen.append(messages) or "<chat>")
    assert prompts == ["<chat>", "<chat>"]
    assert seen[1][-1] == {"role": "user", "content": questions[1]["question"]}
    assert seen[1][1] == {"role": "assistant", "content": shots[0]["answer"]}


# ---------------------------------------------------------------- the CLI
def run_gsm8k(*flags: str, timeout: float = 240) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "bench.gsm8k", *flags], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "gsm8k: 100%" in proc.stderr  # the progress bar ran to the end
    return proc.stdout


def figures_printed(stdout: str) -> dict[str, float]:
    found = {name: pattern.search(stdout) for name, pattern in FIGURE_LINES.items()}
    assert all(found.values()), stdout
    return {name: float(m[1]) for name, m in found.items()}


def check_record(record: dict, printed: dict[str, float], n: int) -> None:
    f = record["figures"]
    assert record["benchmark"] == "gsm8k" and record["machine"]["cores"] >= 1 and record["date"]
    assert record["args"]["num_questions"] == n and len(f["predictions"]) == n
    # Recomputed here from the record's predictions and the data file, not taken from the benchmark.
    golds = [int(q["answer"].rsplit("####", 1)[1].replace(",", "")) for q in read_jsonl("test.jsonl")[:n]]
    correct = sum(p is not None and Decimal(p) == g for p, g in zip(f["predictions"], golds))
    assert f["accuracy"] == correct / n and printed["Accuracy"] == pytest.approx(correct / n, abs=5e-4)
    assert f["invalid"] == sum(p is None for p in f["predictions"]) / n
    assert f["output_throughput"] == pytest.approx(f["completion_tokens"] / f["latency_s"])
    assert printed["Latency"] == pytest.approx(f["latency_s"], abs=5e-4)
    assert 1 <= f["completion_tokens"] <= n * record["args"]["max_new_tokens"]


@pytest.mark.e2e
def test_gsm8k_default_model_few_shot(tmp_path):
    result_file = tmp_path / "gsm8k.jsonl"
    stdout = run_gsm8k("--num-shots", "2", "--num-questions", "3", "--parallel", "2", "--max-new-tokens", "32",
                       "--result-file", str(result_file))
    printed = figures_printed(stdout)
    assert "# 3 questions, 2-shot, plain text" in stdout
    record = json.loads(result_file.read_text())
    check_record(record, printed, 3)
    assert record["prompt_format"] == "few-shot" and record["engine"]["speculative"] is None
    # No speculative_algorithm, but on the CPU free text drafts while it decodes alone (the last question here):
    # its accept length is printed, as the record's.
    assert record["engine"]["free_text_drafting"] == (record["engine"]["device"] == "cpu")
    accept = ACCEPT_LINE.search(stdout)
    assert (accept is None) == (record["figures"].get("accept_length") is None)
    assert accept is None or float(accept[1]) == pytest.approx(record["figures"]["accept_length"], abs=5e-4)


def test_gsm8k_tiny_model_chat_with_ngram(tiny_model_dir, tmp_path):
    result_file = tmp_path / "gsm8k.jsonl"
    stdout = run_gsm8k("--model-path", str(tiny_model_dir), "--chat", "--num-shots", "1", "--num-questions", "3",
                       "--parallel", "3", "--max-new-tokens", "16", "--speculative-algorithm", "NGRAM",
                       "--speculative-num-draft-tokens", "4", "--result-file", str(result_file))
    printed = figures_printed(stdout)
    accept = float(ACCEPT_LINE.search(stdout)[1])
    record = json.loads(result_file.read_text())
    check_record(record, printed, 3)
    f = record["figures"]
    assert record["prompt_format"] == "chat" and record["engine"]["speculative"]["num_draft_tokens"] == 4
    assert f["spec_verify_ct"] >= 1 and 1 <= f["accept_length"] <= 4
    assert accept == pytest.approx(f["spec_accepted_tokens"] / f["spec_verify_ct"], abs=5e-4)
