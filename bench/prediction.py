"""Predicted outputs: tokens/s and accept length of speculative decoding with and without a prediction.

    python -m bench.prediction [--workload gsm8k|json] [--num-prompts 8] [--data-path F] [--max-new-tokens 128]
                               [--algorithms none NGRAM DFLASH] [--result-file F] [engine flags: --dtype ...]

Per prompt (GSM8K questions in the chat template, or the JSON dev set's prompts under their schemas),
plain greedy decoding first gives the reply (``disable_guided_drafting``: no request drafts). Then each
speculative algorithm ("none": the engine without one, which drafts for requests with a prediction or a grammar
alone) decodes the prompts (alone, or
``--batch-size`` at a time), greedy, three ways: without a prediction; with the reply itself ("exact": a client regenerating a reply
it has, or a document it expects back unchanged); and with the reply's every eighth word reversed
("edited": the last version of a document being revised). Every output must be plain decoding's
(checked, printed); tokens/s is completion tokens over the summed request times (prefill included),
accept the accepted tokens per verify over the whole set, both of the median of ``--repeats`` rounds (the
three ways alternated, so a slow spell of the machine does not fall on one of them).
"""
from __future__ import annotations

import argparse
import json
import time

from bench.common import (GSM8K_TEST, add_engine_args, append_jsonl, chat_prompt, command_line, default_speculation,
                          engine_kwargs, gsm8k_questions, jsonschema_prompts, machine_info, now, report_header_lines,
                          without_speculation)
from bench.engine_info import accept_length, spec_totals

KINDS = ("none", "exact", "edited")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.prediction", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="gsm8k", choices=["gsm8k", "json"])
    parser.add_argument("--num-prompts", type=_positive, default=8)
    parser.add_argument("--data-path", default=str(GSM8K_TEST), help="GSM8K-style JSONL (field `question`)")
    parser.add_argument("--max-new-tokens", type=_positive, default=128)
    parser.add_argument("--algorithms", nargs="+", default=["none", "NGRAM", "DFLASH"],
                        choices=["none", "NGRAM", "EAGLE", "DFLASH"],
                        help="none: the engine without speculative_algorithm (which drafts for requests with a prediction "
                        "or a grammar alone)")
    parser.add_argument("--batch-size", type=_positive, default=1,
                        help="requests sent together (each batch one generate call; its time counted once)")
    parser.add_argument("--repeats", type=_positive, default=3,
                        help="rounds of the three ways, alternated; the median round is reported")
    parser.add_argument("--result-file", default=None, help="append one JSON record of the run")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.speculative_algorithm is not None:
        parser.error("give the algorithms with --algorithms (each is run), not --speculative-algorithm")
    return args


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def edited(text: str) -> str:
    """Every eighth word reversed: a prediction right for the most part, wrong here and there."""
    words = text.split(" ")
    return " ".join(w[::-1] if i % 8 == 7 else w for i, w in enumerate(words))


def workload(args, tokenizer) -> list[tuple[str, dict]]:
    """(prompt, sampling params) per request, greedy."""
    base = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    if args.workload == "gsm8k":
        return [(chat_prompt(tokenizer, q["question"]), dict(base)) for q in gsm8k_questions(args.num_prompts, args.data_path)]
    return [(chat_prompt(tokenizer, e["prompt"]), dict(base, json_schema=json.loads(e["schema"])))
            for e in jsonschema_prompts(args.num_prompts)]


def run(engine, requests, predictions: list[str | None], batch_size: int = 1) -> dict:
    """The requests in batches of ``batch_size`` (one generate call each); the output ids, the summed seconds
    and tokens, and the accept length."""
    before = spec_totals(engine)
    outs, seconds = [], 0.0
    for i in range(0, len(requests), batch_size):
        prompts = [prompt for prompt, _ in requests[i:i + batch_size]]
        params = [p if pred is None else dict(p, prediction=pred)
                  for (_, p), pred in zip(requests[i:i + batch_size], predictions[i:i + batch_size])]
        start = time.perf_counter()
        outs += engine.generate(prompts, params)
        seconds += time.perf_counter() - start
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"ids": [o["output_ids"] for o in outs], "tokens": tokens, "seconds": seconds,
            "tok_s": tokens / seconds, "accept": accept_length(before, spec_totals(engine))}


def median_round(rounds: list[dict]) -> dict:
    """The round of median tokens/s (the lower middle one of an even count)."""
    return sorted(rounds, key=lambda r: r["tok_s"])[(len(rounds) - 1) // 2]


def main(argv: list[str] | None = None) -> dict:
    import specjet

    args = parse_args(argv)
    machine, date = machine_info(), now()
    kwargs = without_speculation(engine_kwargs(args))
    with specjet.Engine(**kwargs) as plain:
        requests = workload(args, plain.tokenizer)
        plain.generate(requests[0][0], dict(requests[0][1], max_new_tokens=4))  # warm-up
        reference = median_round([run(plain, requests, [None] * len(requests), args.batch_size)
                                  for _ in range(args.repeats)])
        texts = [plain.tokenizer.decode(ids, skip_special_tokens=True) for ids in reference["ids"]]
        plain.check_kv_invariant()
    predictions = {"none": [None] * len(texts), "exact": texts, "edited": [edited(t) for t in texts]}
    rows = []
    for algorithm in args.algorithms:
        spec_kwargs = (default_speculation(engine_kwargs(args)) if algorithm == "none"
                       else dict(engine_kwargs(args), speculative_algorithm=algorithm))
        with specjet.Engine(**spec_kwargs) as eng:
            eng.generate(requests[0][0], dict(requests[0][1], max_new_tokens=4, prediction=texts[0]))  # warm-up
            rounds = {kind: [] for kind in KINDS}
            for _ in range(args.repeats):
                for kind in KINDS:
                    rounds[kind].append(run(eng, requests, predictions[kind], args.batch_size))
            eng.check_kv_invariant()
        for kind in KINDS:
            r = median_round(rounds[kind])
            rows.append({"algorithm": algorithm, "prediction": kind, "tok_s": round(r["tok_s"], 1),
                         "tok_s_rounds": [round(x["tok_s"], 1) for x in rounds[kind]],
                         "accept": None if r["accept"] is None else round(r["accept"], 2),
                         "vs_plain": round(r["tok_s"] / reference["tok_s"], 2),
                         "identical": all(x["ids"] == reference["ids"] for x in rounds[kind])})
    machine["load_avg_after"] = machine_info()["load_avg"]
    lines = report_header_lines(command_line(), date, machine)
    lines.append(f"# workload: {args.workload}, {len(requests)} prompts in batches of {args.batch_size}, greedy, "
                 f"{args.max_new_tokens} tokens "
                 f"at most; plain decoding {reference['tok_s']:.1f} tok/s ({reference['tokens']} tokens)")
    lines.append("| algorithm | prediction | tok/s | x plain | accept | identical to plain |")
    lines.append("|---|---|---|---|---|---|")
    for row in rows:
        lines.append(f"| {row['algorithm']} | {row['prediction']} | {row['tok_s']} | {row['vs_plain']} | "
                     f"{row['accept']} | {'yes' if row['identical'] else 'NO'} |")
    print("\n".join(lines))
    record = {"command": command_line(), "date": date, "machine": machine, "args": vars(args),
              "plain_tok_s": round(reference["tok_s"], 1), "rows": rows}
    if args.result_file:
        append_jsonl(args.result_file, record)
    return record


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
