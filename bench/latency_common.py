"""What ``python -m bench.latency`` and its ``--sweep`` (bench/spec_sweep.py) share: the command line,
the workloads, what a run loads before its engines, and the frame of the report and the record
(header lines, workload headings, the identity line, printing and appending the record).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench.common import (GSM8K_TEST, JSONSCHEMA_DIR, add_engine_args, append_jsonl, chat_prompt, command_line,
                          compare_outputs, engine_kwargs, gsm8k_questions, jsonschema_prompts, machine_info, now,
                          report_header_lines)
from bench.decode_rate import Measurement, Prompt

WORKLOADS = ("gsm8k", "json")
SWEEP_DEFAULTS = {  # the grid of --sweep (bench/spec_sweep.py)
    "EAGLE": {"num_steps": [1, 3, 5], "topk": [1, 4], "num_draft_tokens": [4, 8, 12, 16], "hybrid_ngram_tokens": [0]},
    "NGRAM": {"num_draft_tokens": [4, 8, 12], "ngram_breadth": [1, 4]},
}


def parse_args(argv: list[str] | None = None, prog: str = "python -m bench.latency",
               description: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default: 1 8 (with --sweep: 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="N, tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system and batch size (median)")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="prompts per workload; a pass generates for all of them")
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, default=None,
                        help="default: gsm8k, or gsm8k json with --speculative-algorithm")
    parser.add_argument("--data-path", default=str(GSM8K_TEST), help="GSM8K-style JSONL (field `question`)")
    parser.add_argument("--json-path", default=str(JSONSCHEMA_DIR),
                        help="folder with index.json (entries under `schemas` with `file` and `prompt`)")
    parser.add_argument("--json-constrained", action="store_true",
                        help="json workload: pass each entry's schema as json_schema (default: no grammar)")
    parser.add_argument("--skip-hf", action="store_true", help="time specjet only")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also time llama.cpp (llama-cpp-python) on the model's GGUF file, batch size 1 only")
    parser.add_argument("--result-file", default=None, help="append a JSON record to this .jsonl file")
    sweep = parser.add_argument_group("sweep", "--sweep times every configuration of a grid of the speculative "
                                               "algorithm (impossible EAGLE trees skipped)")
    sweep.add_argument("--sweep", action="store_true", help="needs --speculative-algorithm")
    sweep.add_argument("--sweep-num-steps", type=int, nargs="+", default=None, help="EAGLE (default 1 3 5)")
    sweep.add_argument("--sweep-topk", type=int, nargs="+", default=None, help="EAGLE (default 1 4)")
    sweep.add_argument("--sweep-num-draft-tokens", type=int, nargs="+", default=None,
                       help="default: EAGLE 4 8 12 16, NGRAM 4 8 12")
    sweep.add_argument("--sweep-ngram-breadth", type=int, nargs="+", default=None, help="NGRAM (default 1 4)")
    sweep.add_argument("--sweep-hybrid-ngram-tokens", type=int, nargs="+", default=None,
                       help="EAGLE: n-gram nodes merged into each tree (default 0)")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (decode starts after the first token)")
    if args.batch_sizes is None:
        args.batch_sizes = [1] if args.sweep else [1, 8]
    if args.repeats < 1 or args.num_prompts < 1 or min(args.batch_sizes) < 1:
        parser.error("--repeats, --num-prompts and --batch-sizes must be positive")
    args.batch_sizes = sorted(set(args.batch_sizes))
    if args.workload is None:
        args.workload = list(WORKLOADS) if args.speculative_algorithm else ["gsm8k"]
    args.workload = list(dict.fromkeys(args.workload))
    if args.json_constrained and "json" not in args.workload:
        parser.error("--json-constrained needs the json workload (--workload json)")
    if args.sweep and args.llamacpp:
        parser.error("--llamacpp times llama.cpp beside specjet's systems, not beside a --sweep")
    grid_flags = {"num_steps": args.sweep_num_steps, "topk": args.sweep_topk,
                  "num_draft_tokens": args.sweep_num_draft_tokens, "ngram_breadth": args.sweep_ngram_breadth,
                  "hybrid_ngram_tokens": args.sweep_hybrid_ngram_tokens}
    if args.sweep:
        if args.speculative_algorithm not in SWEEP_DEFAULTS:
            parser.error(f"--sweep needs --speculative-algorithm {' or '.join(SWEEP_DEFAULTS)}"
                         + (f", not {args.speculative_algorithm}" if args.speculative_algorithm else ""))
        pinned = [f"--speculative-{name.replace('_', '-')}" for name in
                  ("num_steps", "eagle_topk", "num_draft_tokens", "ngram_max_bfs_breadth", "hybrid_ngram_tokens")
                  if getattr(args, f"speculative_{name}") is not None]
        if pinned:
            parser.error(f"with --sweep, give the grid with --sweep-* flags, not {', '.join(pinned)}")
        defaults = SWEEP_DEFAULTS[args.speculative_algorithm]
        unused = [f"--sweep-{k.replace('_', '-')}" for k, v in grid_flags.items()
                  if v is not None and k not in defaults]
        if unused:
            parser.error(f"{', '.join(unused)} do not apply to {args.speculative_algorithm}")
        for k, v in grid_flags.items():
            least = 0 if k == "hybrid_ngram_tokens" else 1  # no n-gram nodes is a configuration
            if k in defaults and v is not None and min(v) < least:
                parser.error(f"--sweep-{k.replace('_', '-')} values must be >= {least}")
        args.sweep_grid = {k: sorted(set(grid_flags[k] or v)) for k, v in defaults.items()}
    elif any(v is not None for v in grid_flags.values()):
        parser.error("--sweep-* flags need --sweep")
    return args


# ---------------------------------------------------------------- workloads
@dataclass
class Workload:
    name: str
    description: str
    prompts: list[Prompt]
    constrained: bool = False

    def info(self) -> dict:
        lengths = [len(p.ids) for p in self.prompts]
        return {"description": self.description, "constrained": self.constrained,
                "prompt_tokens": {"count": len(lengths), "min": min(lengths), "max": max(lengths),
                                  "mean": sum(lengths) / len(lengths)}}


def load_workloads(args: argparse.Namespace, tokenizer) -> list[Workload]:
    """Each workload's prompts, chat-formatted and tokenized once, as Engine.generate(prompt) would."""
    def ids(text: str) -> list[int]:
        return tokenizer(chat_prompt(tokenizer, text))["input_ids"]

    workloads = []
    for name in args.workload:
        if name == "gsm8k":
            questions = gsm8k_questions(args.num_prompts, args.data_path)
            workloads.append(Workload(name, "chat-formatted GSM8K test questions",
                                      [Prompt(ids(q["question"])) for q in questions]))
        else:
            entries = jsonschema_prompts(args.num_prompts, args.json_path)
            constrained = args.json_constrained
            how = "decoded under their schemas (json_schema)" if constrained else "decoded without the grammar"
            workloads.append(Workload(name, f"chat-formatted JSON-schema prompts, {how}",
                                      [Prompt(ids(e["prompt"]), e["schema"] if constrained else None)
                                       for e in entries], constrained))
    return workloads


@dataclass
class Setup:
    """What a run loads before its engines."""
    workloads: list[Workload]
    context: dict  # for the record's header: command, date, machine, model_dir, device, specjet_dtype and
    # specjet_quantization, hf_dtype
    hf: dict | None  # HFSystem's arguments (model_dir, dtype, device, pad_token_id); None: HF is not timed


def prepare(args: argparse.Namespace) -> Setup:
    command, date = command_line(), now()

    import torch
    from transformers import AutoTokenizer

    from specjet.models.runner import resolve_dtype
    from specjet.models.weights import resolve_model_path

    if args.speculative_algorithm == "EAGLE" and not args.speculative_draft_model_path:
        from specjet.models.eagle import default_eagle_path

        if not default_eagle_path().exists():
            raise SystemExit(f"bench.latency: no EAGLE head at {default_eagle_path()} (the default); "
                             "give one with --speculative-draft-model-path")
    model_dir = resolve_model_path(args.model_path)
    device = torch.device(args.device if args.device not in (None, "auto") else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    quantization = _quantization(args, device, model_dir)
    specjet_dtype = resolve_dtype(args.dtype, device, quantization)
    hf_dtype = specjet_dtype  # transformers computes with the float weights, in specjet's activation dtype
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workloads = load_workloads(args, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    skip_hf = args.skip_hf or args.sweep or all(w.constrained for w in workloads)  # HF has no grammar
    context = {
        "command": command, "date": date,
        "machine": machine_info(),  # before the load it describes the machine as the runs found it
        "model_dir": str(model_dir), "device": str(device),
        "specjet_dtype": str(specjet_dtype).removeprefix("torch."),
        "specjet_quantization": quantization,  # None: float weights in specjet_dtype
        "hf_dtype": None if skip_hf else str(hf_dtype).removeprefix("torch."),
    }
    hf = None if skip_hf else {"model_dir": model_dir, "dtype": hf_dtype, "device": device, "pad_token_id": pad}
    return Setup(workloads, context, hf)


def _quantization(args: argparse.Namespace, device, model_dir) -> str | None:
    """The quantization the engine will use (its default ``auto`` resolved, ``none`` is None)."""
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.quantize import choose_method
    from specjet.models.weights import gguf_source

    requested = engine_kwargs(args).get("quantization", "auto")  # unset: the engine's default
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    return choose_method(requested, device, gguf_source(args.model_path), config)[0]


# ---------------------------------------------------------------- the report's frame
OTHER_ENGINES = ("HF", "llama.cpp")  # systems that are not specjet (bench/latency.py, bench/llamacpp_system.py)


def identity_check(measurements: list[Measurement], plain: str) -> dict:
    """Every other specjet system's N-token outputs against ``plain``'s on the same workload, batch size
    and run (other engines left out: HF returns no ids, llama.cpp computes with other kernels)."""
    outputs = {(m.system, m.workload, m.batch_size): m.outputs for m in measurements
               if m.outputs and m.system not in OTHER_ENGINES}
    return compare_outputs(dict(sorted(outputs.items())), plain, ("system", "workload", "batch_size"))


def identity_line(check: dict, what: str) -> str:
    if check["identical"]:
        return f"outputs identical: yes ({what}: {check['requests']} requests in {check['passes']} N-token passes)"
    first = check["mismatches"][0]
    return (f"outputs identical: NO ({what}: {check['mismatched_requests']} of {check['requests']} requests differ; "
            f"first: {first['system']} {first['workload']} bs{first['batch_size']} run {first['run'] + 1} request "
            f"{first['request']} from token {first['first_differing_token']})")


def header_lines(header: dict) -> list[str]:
    return report_header_lines(header["command"], header["date"], header["machine"]) + [
        f"# model: {header['model_dir']} on {header['device']}; specjet {header['specjet_dtype']} "
        + (f"with {header['specjet_quantization']} weights" if header.get("specjet_quantization")
           else "with float weights")
        + (f", HF {header['hf_dtype']} with float weights" if header.get("hf_dtype") else ""),
    ]


def workload_heading(name: str, info: dict) -> str:
    t = info["prompt_tokens"]
    return f"## {name}: {t['count']} {info['description']} ({t['min']}-{t['max']} prompt tokens, mean {t['mean']:.0f})"


def make_header(benchmark: str, context: dict, workloads: list[Workload], args: argparse.Namespace) -> dict:
    return {
        "benchmark": benchmark,
        "record_version": 2,
        "command": context["command"],
        "date": context["date"],
        "machine": dict(context["machine"], load_avg_after=machine_info()["load_avg"]),
        "model_dir": context["model_dir"],
        "device": context["device"],
        "specjet_dtype": context["specjet_dtype"],
        "specjet_quantization": context["specjet_quantization"],
        "hf_dtype": context["hf_dtype"],
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "batch_sizes": args.batch_sizes,
        "workloads": {w.name: w.info() for w in workloads},
    }


def finish(record: dict, report: str, args: argparse.Namespace) -> dict:
    """Print, append the record, and fail if greedy outputs differed."""
    print(report, flush=True)
    if args.result_file:
        append_jsonl(args.result_file, record)
        print(f"# appended to {args.result_file}", flush=True)
    identity = record.get("outputs_identical")
    if identity is not None and not identity["identical"]:
        raise SystemExit("bench.latency: speculative greedy outputs differ from plain decoding (see above)")
    return record
