"""GSM8K accuracy and throughput, printed as SGLang's ``benchmark/gsm8k/bench_sglang.py`` prints them
so that the figures can be set beside SGLang's.

    python -m bench.gsm8k [--num-shots 5] [--num-questions 200] [--parallel 64] [--max-new-tokens 256]
                          [--chat] [--data-path ../shared/data/gsm8k] [--result-file bench/out/gsm8k.jsonl]
                          [engine flags: --speculative-algorithm EAGLE --speculative-num-steps 4 ...]

After a progress bar it prints

    Accuracy: 0.xxx            correct / questions
    Invalid: 0.xxx             answers with no number at all / questions (they count as wrong too)
    Latency: x.xxx s           wall time from the first request sent to the last answer back
    Output throughput: x.xxx token/s   completion tokens of all answers / latency
    Accept length: x.xxx       speculative only: accepted tokens / verify forwards over the run

Prompts, as SGLang builds them: the first ``--num-shots`` solved examples of GSM8K *train* (their
reference solutions verbatim, ``<<48/2=24>>`` calculator notes and ``#### 72`` included), each
"Question: ...\\nAnswer: ...\\n\\n", then "Question: {q}\\nAnswer:" for each of the first
``--num-questions`` *test* questions. ``--chat`` sends the same conversation through the model's chat
template instead (each shot a user turn with the question and an assistant turn with the solution,
then the test question as the last user turn), which suits instruction-tuned models such as the
default SmolLM2-135M-Instruct. Decoding is greedy (temperature 0), at most ``--max-new-tokens``,
ending at EOS or at SGLang's stop strings "Question", "Assistant:", "<|separator|>", "\\n\\n\\n".

Scoring: the gold answer is the number after "####" in the test solution; the prediction is the
last number in the generated text (bench/answer_parsing.py: thousands commas, "$", negatives and
decimals understood, so "1,234", "$1234" and "1234.0" all equal 1234); no number at all is invalid.

Requests go to one engine concurrently, at most ``--parallel`` in flight (``async_generate`` under an
anyio ``CapacityLimiter``); the engine itself runs at most ``--max-running-requests`` at once and
queues the rest. Before the timed run one short request warms the engine up; its tokens count in
none of the figures (the speculative totals are read before and after the run). ``--result-file``
appends one JSON record: command, date, machine, arguments, the figures and every prediction.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

from bench.answer_parsing import gold_answer, last_number, number_str
from bench.common import (GSM8K_TEST, add_engine_args, append_jsonl, command_line, engine_kwargs, generate_all,
                          gsm8k_questions, machine_info, machine_line, now)
from bench.engine_info import accept_length, describe_engine, speculation_str, spec_totals

GSM8K_DIR = pathlib.Path(GSM8K_TEST).parent  # train.jsonl (the shots) and test.jsonl (the questions)
STOP = ["Question", "Assistant:", "<|separator|>", "\n\n\n"]  # SGLang's benchmark/gsm8k stop strings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gsm8k", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-shots", type=int, default=5, help="solved train examples before each question")
    parser.add_argument("--num-questions", type=int, default=200, help="the first N test questions (all: 1319)")
    parser.add_argument("--parallel", type=int, default=64, help="requests in flight at once")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--chat", action="store_true", help="put the shots and the question in the chat template")
    parser.add_argument("--data-path", default=str(GSM8K_DIR), help="folder with GSM8K's train.jsonl and test.jsonl")
    parser.add_argument("--result-file", default=None, help="append a JSON record to this .jsonl file")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.num_shots < 0:
        parser.error("--num-shots must be >= 0")
    if args.num_questions < 1 or args.parallel < 1 or args.max_new_tokens < 1:
        parser.error("--num-questions, --parallel and --max-new-tokens must be positive")
    for name in ("train.jsonl", "test.jsonl"):
        if not (pathlib.Path(args.data_path) / name).is_file():
            parser.error(f"--data-path {args.data_path} has no {name}")
    return args


# ---------------------------------------------------------------- prompts
def few_shot_prompt(shots: list[dict], question: str) -> str:
    """SGLang's plain-text prompt: the solved shots, then the question with an open answer."""
    solved = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    return f"{solved}Question: {question}\nAnswer:"


def chat_messages(shots: list[dict], question: str) -> list[dict]:
    """The same conversation as chat turns: each shot a question and its solution, then the question."""
    turns = []
    for s in shots:
        turns += [{"role": "user", "content": s["question"]}, {"role": "assistant", "content": s["answer"]}]
    return turns + [{"role": "user", "content": question}]


def build_prompts(shots: list[dict], questions: list[dict], chat_template=None) -> list[str]:
    """One prompt per question; ``chat_template`` (messages -> text, e.g. ``Engine.apply_chat_template``)
    selects the chat form."""
    if chat_template is None:
        return [few_shot_prompt(shots, q["question"]) for q in questions]
    return [chat_template(chat_messages(shots, q["question"])) for q in questions]


# ---------------------------------------------------------------- scoring
def score(questions: list[dict], outputs: list[dict]) -> dict:
    """Accuracy and invalid rate of the outputs against the questions' gold answers. An aborted request's text is
    no answer (its last number is wherever the engine stopped it): it is invalid."""
    golds = [gold_answer(q["answer"]) for q in questions]
    preds = [None if _aborted(o) else last_number(o["text"]) for o in outputs]
    correct = sum(p is not None and p == g for p, g in zip(preds, golds))
    invalid = sum(p is None for p in preds)
    n = len(questions)
    return {"accuracy": correct / n, "invalid": invalid / n, "correct": correct, "invalid_count": invalid,
            "questions": n, "predictions": [number_str(p) for p in preds], "golds": [number_str(g) for g in golds]}


def _aborted(output: dict) -> bool:
    return ((output.get("meta_info") or {}).get("finish_reason") or {}).get("type") == "abort"


def figure_lines(figures: dict) -> list[str]:
    """SGLang's lines (same names, units and precision), then the accept length when speculating."""
    lines = [f"Accuracy: {figures['accuracy']:.3f}",
             f"Invalid: {figures['invalid']:.3f}",
             f"Latency: {figures['latency_s']:.3f} s",
             f"Output throughput: {figures['output_throughput']:.3f} token/s"]
    if figures.get("accept_length") is not None:
        lines.append(f"Accept length: {figures['accept_length']:.3f}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command, date, machine = command_line(), now(), machine_info()

    from tqdm.auto import tqdm

    import specjet
    from specjet.models.weights import resolve_model_path

    data = pathlib.Path(args.data_path)
    try:
        shots = gsm8k_questions(args.num_shots, data / "train.jsonl") if args.num_shots else []
        questions = gsm8k_questions(args.num_questions, data / "test.jsonl")
    except ValueError as exc:
        raise SystemExit(f"bench.gsm8k: {exc}") from None
    kwargs = engine_kwargs(args)
    model_dir = resolve_model_path(args.model_path)
    print(f"loading {model_dir} ...", file=sys.stderr)
    try:
        engine = specjet.Engine(**kwargs)
    except (TypeError, ValueError, NotImplementedError, FileNotFoundError) as exc:
        raise SystemExit(f"bench.gsm8k: the engine cannot be loaded: {exc}") from None
    try:
        prompts = build_prompts(shots, questions, engine.apply_chat_template if args.chat else None)
        params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "stop": STOP}
        engine.generate(prompts[0], dict(params, max_new_tokens=4))  # warm-up, outside every figure
        before = spec_totals(engine)
        with tqdm(total=len(prompts), unit="q", desc="gsm8k", file=sys.stderr, dynamic_ncols=True) as bar:
            start = time.perf_counter()
            outputs = generate_all(engine, prompts, params, args.parallel, bar)
            latency = time.perf_counter() - start
        after = spec_totals(engine)
        setup = describe_engine(engine)
    finally:
        engine.shutdown()

    figures = score(questions, outputs)
    completion_tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    prompt_tokens = [o["meta_info"]["prompt_tokens"] for o in outputs]
    figures.update(latency_s=latency, output_throughput=completion_tokens / latency,
                   completion_tokens=completion_tokens, prompt_tokens=sum(prompt_tokens),
                   finish_reasons=dict(collections.Counter(o["meta_info"]["finish_reason"]["type"] for o in outputs)))
    if before is not None:
        figures.update(spec_verify_ct=after[0] - before[0], spec_accepted_tokens=after[1] - before[1],
                       accept_length=accept_length(before, after))

    form = "chat template" if args.chat else "plain text"
    header = [
        f"# command: {command}",
        f"# date: {date}",
        machine_line(machine),
        f"# model: {model_dir} ({setup['dtype']} on {setup['device']}); speculative {speculation_str(setup)}",
        f"# {len(questions)} questions, {args.num_shots}-shot, {form} ({min(prompt_tokens)}-{max(prompt_tokens)} "
        f"prompt tokens), greedy, at most {args.max_new_tokens} new tokens; up to {args.parallel} in flight, "
        f"the engine runs {setup['max_running_requests']} at once",
    ]
    aborted = [o["meta_info"]["finish_reason"] for o in outputs if o["meta_info"]["finish_reason"]["type"] == "abort"]
    if aborted:  # they count as invalid answers; say why they happened
        header.append(f"# WARNING: {len(aborted)} requests aborted (first: {aborted[0].get('message')})")
    print("\n".join(header + figure_lines(figures)), flush=True)
    record = {"benchmark": "gsm8k", "record_version": 1, "command": command, "date": date,
              "machine": dict(machine, load_avg_after=machine_info()["load_avg"]), "model_dir": str(model_dir),
              "args": vars(args), "engine_kwargs": kwargs, "engine": setup,
              "prompt_format": "chat" if args.chat else "few-shot", "figures": figures}
    if args.result_file:
        append_jsonl(args.result_file, record)
        print(f"# appended to {args.result_file}", flush=True)
    return record


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
