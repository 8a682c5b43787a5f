"""Decode tokens/s of specjet against Hugging Face transformers ``generate``, at batch sizes 1 and 8.

    python -m bench.latency [--batch-sizes 1 8] [--max-new-tokens 64] [--repeats 3] [--num-prompts 8]
                            [--skip-hf] [--result-file bench/out/latency.jsonl] [engine flags]

Both systems load the same weights (the model directory ``resolve_model_path(--model-path)``; fp32
unless ``--dtype bfloat16``, which puts both in bf16), get the same token ids (chat-formatted GSM8K
test questions, tokenized once) and generate exactly N = ``--max-new-tokens`` tokens greedily (EOS
ignored: ``ignore_eos`` for specjet, ``min_new_tokens=N`` for transformers). A batch of B for
transformers is left-padded with the pad token and run as one ``generate`` call; for specjet it is
one ``Engine.generate`` call with B prompts.

How decode tokens/s is measured (the same for both systems, with a wall clock outside both):
the prompts are cycled up to a multiple of B and cut into batches of B; one *pass* runs all batches
one after the other. Each run times two passes over the same batches, t_N with max_new_tokens=N and
t_1 with max_new_tokens=1 (prefill and first token only), and

    decode tokens/s = requests * (N - 1) / (t_N - t_1)

i.e. the tokens generated after the first, over the time spent after the first. Whatever both
passes share (tokenizing, prefill, scheduling and returning a request) cancels; no system's own
timestamps are trusted. A table gives the median over ``--repeats`` runs with min and max, then
specjet/HF at each batch size and each system's scaling from the smallest batch size to the others.

Before timing, each system runs one batch at each batch size (N tokens and 1 token) to warm up. Runs
are interleaved (repeat, batch size, system) so that drifting load on a shared machine hits both
systems alike. ``torch.set_num_threads`` is left at its default. ``--result-file`` appends one JSON
record per invocation (command, date, machine, arguments, every timing and the figures).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

from bench.common import (GSM8K_TEST, add_engine_args, append_jsonl, chat_prompt, command_line, engine_kwargs,
                          gsm8k_questions, machine_info, now)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64, help="N, tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system and batch size (median)")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="GSM8K test questions used; a pass generates for all of them")
    parser.add_argument("--data-path", default=str(GSM8K_TEST), help="GSM8K-style JSONL (field `question`)")
    parser.add_argument("--skip-hf", action="store_true", help="time specjet only")
    parser.add_argument("--result-file", default=None, help="append a JSON record to this .jsonl file")
    add_engine_args(parser)
    parser.set_defaults(dtype="float32")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (decode starts after the first token)")
    if args.repeats < 1 or args.num_prompts < 1 or min(args.batch_sizes) < 1:
        parser.error("--repeats, --num-prompts and --batch-sizes must be positive")
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


# ---------------------------------------------------------------- the two systems
class SpecjetSystem:
    name = "specjet"

    def __init__(self, args: argparse.Namespace):
        import specjet

        self.engine = specjet.Engine(**engine_kwargs(args))

    def generate(self, batch: list[list[int]], max_new_tokens: int) -> None:
        outs = self.engine.generate(input_ids=batch, sampling_params={
            "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True})
        for out in outs:  # a short or aborted request would make the figure meaningless
            if out["meta_info"]["completion_tokens"] != max_new_tokens:
                raise RuntimeError(f"specjet returned {out['meta_info']['completion_tokens']} tokens, not "
                                   f"{max_new_tokens}: {out['meta_info']['finish_reason']}")

    def close(self) -> None:
        self.engine.shutdown()


class HFSystem:
    name = "HF"

    def __init__(self, model_dir, dtype, device, pad_token_id: int):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()  # greedy while generation_config.json sets temperature
        self.torch = torch
        self.device = device
        self.pad_token_id = pad_token_id
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()

    def generate(self, batch: list[list[int]], max_new_tokens: int) -> None:
        torch = self.torch
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(ids)) + ids for ids in batch], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_token_id)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if out.shape[1] != width + max_new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {max_new_tokens}")

    def close(self) -> None:
        del self.model


# ---------------------------------------------------------------- measuring
@dataclass
class Measurement:
    system: str
    batch_size: int
    requests: int  # per pass: num_prompts rounded up to a multiple of batch_size
    max_new_tokens: int
    t_1: list[float] = field(default_factory=list)  # seconds per pass, max_new_tokens=1
    t_n: list[float] = field(default_factory=list)  # seconds per pass, max_new_tokens=N

    @property
    def rates(self) -> list[float]:
        """Decode tokens/s of each run; NaN where noise made t_N <= t_1."""
        tokens = self.requests * (self.max_new_tokens - 1)
        return [tokens / (n - one) if n > one else math.nan for one, n in zip(self.t_1, self.t_n)]

    def summary(self) -> dict:
        valid = [r for r in self.rates if not math.isnan(r)]
        return {
            "median": statistics.median(valid) if valid else None,
            "min": min(valid) if valid else None,
            "max": max(valid) if valid else None,
        }


def make_batches(prompt_ids: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """The prompts, cycled up to a multiple of ``batch_size`` so every batch is full, in batches."""
    count = math.ceil(len(prompt_ids) / batch_size) * batch_size
    cycled = [prompt_ids[i % len(prompt_ids)] for i in range(count)]
    return [cycled[i:i + batch_size] for i in range(0, count, batch_size)]


def timed_pass(system, batches, max_new_tokens: int) -> float:
    start = time.perf_counter()
    for batch in batches:
        system.generate(batch, max_new_tokens)
    return time.perf_counter() - start


def measure(systems, prompt_ids: list[list[int]], args: argparse.Namespace) -> list[Measurement]:
    from tqdm.auto import tqdm

    n = args.max_new_tokens
    batches = {bs: make_batches(prompt_ids, bs) for bs in args.batch_sizes}
    table = {(s.name, bs): Measurement(s.name, bs, sum(map(len, batches[bs])), n)
             for bs in args.batch_sizes for s in systems}
    total = len(systems) * len(args.batch_sizes) * (1 + args.repeats)
    with tqdm(total=total, unit="run", desc="bench.latency", file=sys.stderr, dynamic_ncols=True) as bar:
        for bs in args.batch_sizes:
            for system in systems:
                bar.set_description(f"warm-up {system.name} bs={bs}")
                system.generate(batches[bs][0], n)
                system.generate(batches[bs][0], 1)
                bar.update()
        for repeat in range(args.repeats):
            for bs in args.batch_sizes:
                for system in systems:
                    bar.set_description(f"run {repeat + 1}/{args.repeats} {system.name} bs={bs}")
                    m = table[(system.name, bs)]
                    m.t_1.append(timed_pass(system, batches[bs], 1))
                    m.t_n.append(timed_pass(system, batches[bs], n))
                    rate = m.rates[-1]
                    bar.set_postfix_str(f"{rate:.1f} tok/s" if not math.isnan(rate) else "t_N <= t_1")
                    bar.update()
    return list(table.values())


# ---------------------------------------------------------------- reporting
def ratios(measurements: list[Measurement]) -> tuple[dict, dict]:
    """specjet/HF per batch size, and each system's scaling from the smallest batch size."""
    median = {(m.system, m.batch_size): m.summary()["median"] for m in measurements}
    sizes = sorted({m.batch_size for m in measurements})
    systems = list(dict.fromkeys(m.system for m in measurements))

    def ratio(a, b):
        return a / b if a is not None and b else None

    vs_hf = {str(bs): ratio(median[("specjet", bs)], median.get(("HF", bs))) for bs in sizes} if "HF" in systems else {}
    scaling = {s: {f"{bs}/{sizes[0]}": ratio(median[(s, bs)], median[(s, sizes[0])]) for bs in sizes[1:]}
               for s in systems}
    return vs_hf, scaling


def _num(x, spec=".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def format_report(header: dict, measurements: list[Measurement], vs_hf: dict, scaling: dict) -> str:
    m = header["machine"]
    lengths = header["prompt_tokens"]
    lines = [
        f"# command: {header['command']}",
        f"# date: {header['date']}",
        f"# machine: {m['cpu']}; {m['usable_cores']}/{m['cores']} cores usable, torch threads {m['torch_threads']}, "
        f"load avg {m['load_avg']} before, {m['load_avg_after']} after" + (f", GPU {m['gpu']}" if m["gpu"] else ""),
        f"# versions: torch {m['torch']}, transformers {m['transformers']}, specjet {m['specjet']}, "
        f"python {m['python']}, commit {m['git_commit']}",
        f"# model: {header['model_dir']} on {header['device']}; specjet {header['specjet_dtype']}, "
        f"HF {header['hf_dtype']}",
        f"# workload: {lengths['count']} chat-formatted GSM8K test prompts ({lengths['min']}-{lengths['max']} tokens, "
        f"mean {lengths['mean']:.0f}), N={header['max_new_tokens']} new tokens, greedy, median of "
        f"{header['repeats']}",
        "# decode tok/s = requests * (N-1) / (t_N - t_1), wall clock of the same batches with N and 1 new tokens",
        "",
        f"{'system':<8} {'batch':>5} {'decode tok/s':>12} {'min':>8} {'max':>8} {'t_1 s':>8} {'t_N s':>8}",
    ]
    for x in sorted(measurements, key=lambda x: (x.batch_size, x.system != "specjet")):
        s = x.summary()
        lines.append(f"{x.system:<8} {x.batch_size:>5} {_num(s['median']):>12} {_num(s['min']):>8} {_num(s['max']):>8} "
                     f"{statistics.median(x.t_1):>8.3f} {statistics.median(x.t_n):>8.3f}")
    lines.append("")
    if vs_hf:
        lines.append("specjet/HF: " + ", ".join(f"bs{bs} {_num(r, '.2f')}x" for bs, r in vs_hf.items()))
    for system, per_size in scaling.items():
        if per_size:
            lines.append(f"scaling {system}: " + ", ".join(f"bs{k.replace('/', '/bs')} {_num(r, '.2f')}x"
                                                           for k, r in per_size.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command, date = command_line(), now()

    import torch
    from transformers import AutoTokenizer

    from specjet.models.runner import resolve_dtype
    from specjet.models.weights import resolve_model_path

    model_dir = resolve_model_path(args.model_path)
    device = torch.device(args.device if args.device not in (None, "auto") else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    specjet_dtype = resolve_dtype(args.dtype, device)
    hf_dtype = torch.bfloat16 if specjet_dtype == torch.bfloat16 else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # Tokenized once, as Engine.generate(prompt) would, and handed to both systems as ids.
    prompt_ids = [tokenizer(chat_prompt(tokenizer, q["question"]))["input_ids"]
                  for q in gsm8k_questions(args.num_prompts, args.data_path)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    machine = machine_info()  # before the load it describes the machine as the runs found it
    print(f"loading {'specjet' if args.skip_hf else 'specjet and HF'} from {model_dir} ...", file=sys.stderr)
    systems = [SpecjetSystem(args)]
    try:
        if not args.skip_hf:
            systems.append(HFSystem(model_dir, hf_dtype, device, pad))
        measurements = measure(systems, prompt_ids, args)
    finally:
        for system in systems:
            system.close()

    lengths = [len(ids) for ids in prompt_ids]
    header = {
        "benchmark": "latency",
        "command": command,
        "date": date,
        "machine": dict(machine, load_avg_after=machine_info()["load_avg"]),
        "model_dir": str(model_dir),
        "device": str(device),
        "specjet_dtype": str(specjet_dtype).removeprefix("torch."),
        "hf_dtype": None if args.skip_hf else str(hf_dtype).removeprefix("torch."),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "prompt_tokens": {"count": len(lengths), "min": min(lengths), "max": max(lengths),
                          "mean": sum(lengths) / len(lengths)},
    }
    vs_hf, scaling = ratios(measurements)
    print(format_report(header, measurements, vs_hf, scaling), flush=True)

    record = dict(header, args=vars(args), specjet_over_hf=vs_hf, scaling=scaling, results=[
        {"system": m.system, "batch_size": m.batch_size, "requests": m.requests,
         "decode_tok_s": m.summary(), "runs_decode_tok_s": [None if math.isnan(r) else r for r in m.rates],
         "t_1_s": m.t_1, "t_n_s": m.t_n}
        for m in measurements])
    if args.result_file:
        append_jsonl(args.result_file, record)
        print(f"# appended to {args.result_file}", flush=True)
    return record


if __name__ == "__main__":
    main()
