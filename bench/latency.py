"""Decode tokens/s of specjet against Hugging Face transformers ``generate``, and of speculative
decoding (EAGLE, NGRAM) against plain decoding, at batch sizes 1 and 8.

    python -m bench.latency [--batch-sizes 1 8] [--max-new-tokens 64] [--repeats 3] [--num-prompts 8]
                            [--workload gsm8k json] [--json-constrained] [--skip-hf]
                            [--speculative-algorithm EAGLE|NGRAM [--speculative-num-steps S] ...]
                            [--sweep [--sweep-num-steps ...]] [--result-file bench/out/latency.jsonl]
                            [engine flags]

All systems load the same weights (the model directory ``resolve_model_path(--model-path)``, all in
``--dtype``; default auto: bf16 on a CPU with native bf16 instructions, else fp32), get the same
token ids (tokenized once) and generate exactly N = ``--max-new-tokens`` tokens greedily (EOS ignored: ``ignore_eos``
for specjet, ``min_new_tokens=N`` for transformers). A batch of B for transformers is left-padded
with the pad token and run as one ``generate`` call; for specjet it is one ``Engine.generate`` call
with B prompts.

Workloads (``--workload``; default gsm8k, or gsm8k and json when speculating), ``--num-prompts``
of each: *gsm8k*, chat-formatted GSM8K test questions; *json*, the chat-formatted ``prompt`` of the
first entries of ``../shared/data/jsonschema/index.json``, decoded without the grammar unless
``--json-constrained`` (each entry's schema then goes in as ``json_schema``; a request ends early
when its object is complete, so decode tokens are counted rather than assumed, and HF, which has no
grammar, is left out of that workload).

How decode tokens/s is measured (the same for every system, with a wall clock outside all of them):
the prompts are cycled up to a multiple of B and cut into batches of B; one *pass* runs all batches
one after the other. Each run times two passes over the same batches, t_N with max_new_tokens=N and
t_1 with max_new_tokens=1 (prefill and first token only), and

    decode tokens/s = requests * (N - 1) / (t_N - t_1)

i.e. the tokens generated after the first, over the time spent after the first. Whatever both
passes share (tokenizing, prefill, scheduling and returning a request) cancels; no system's own
timestamps are trusted. A table gives the median over ``--repeats`` runs with min and max, then
the ratios between systems at each batch size and each system's scaling from the smallest batch
size to the others.

Speculative decoding (``--speculative-algorithm``): the same run loads two engines, "specjet"
(plain: the same flags without the ``--speculative-*`` ones) and "specjet+EAGLE" (or +NGRAM), and
times both (and HF unless ``--skip-hf``) on the same batches. For the speculative one it reports

    accept length = accepted tokens / verify forwards

over the timed N-token passes, from the engine's running totals (``get_server_info()["stats"]``)
read before and after each pass (a request's first token comes from prefill, every later one from a
verify forward), and the speed-up, its decode tok/s over plain's. Greedy decoding must give the same
tokens whatever the drafts: the output ids of every timed N-token pass are compared with plain's on
the same batches, "outputs identical: yes" is printed, and a mismatch fails the command (after the
report and the record are written).

``--sweep`` (bench/spec_sweep.py) times a grid of configurations of the speculative algorithm
instead, one engine per configuration, against a plain engine.

Before timing, each system warms up at each workload and batch size (one batch with N tokens, then
every batch with 1). Runs are interleaved (repeat, workload, batch size, system) so that drifting
load on a shared machine hits all systems alike. ``torch.set_num_threads`` is left at its default.
``--result-file`` appends one JSON record per invocation (command, date, machine, arguments, every
timing and the figures).
"""
from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
import time
from dataclasses import dataclass, field

from bench.common import (GSM8K_TEST, JSONSCHEMA_DIR, add_engine_args, append_jsonl, chat_prompt, command_line,
                          engine_kwargs, gsm8k_questions, jsonschema_prompts, machine_info, now, report_header_lines,
                          without_speculation)
from bench.engine_info import describe_engine, spec_str

WORKLOADS = ("gsm8k", "json")
PLAIN = "specjet"
SWEEP_DEFAULTS = {  # the grid of --sweep (bench/spec_sweep.py)
    "EAGLE": {"num_steps": [1, 3, 5], "topk": [1, 4], "num_draft_tokens": [4, 8, 12, 16], "hybrid_ngram_tokens": [0]},
    "NGRAM": {"num_draft_tokens": [4, 8, 12], "ngram_breadth": [1, 4]},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__.split("\n\n")[0],
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
    grid_flags = {"num_steps": args.sweep_num_steps, "topk": args.sweep_topk,
                  "num_draft_tokens": args.sweep_num_draft_tokens, "ngram_breadth": args.sweep_ngram_breadth,
                  "hybrid_ngram_tokens": args.sweep_hybrid_ngram_tokens}
    if args.sweep:
        if not args.speculative_algorithm:
            parser.error("--sweep needs --speculative-algorithm EAGLE or NGRAM")
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
class Prompt:
    ids: list[int]
    json_schema: str | None = None  # set: decoded under this schema (json workload, --json-constrained)


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


# ---------------------------------------------------------------- the systems
class SpecjetSystem:
    def __init__(self, name: str, kwargs: dict):
        import specjet

        self.name = name
        self.kwargs = kwargs
        self.algorithm = kwargs.get("speculative_algorithm")
        self.engine = specjet.Engine(**kwargs)

    def supports(self, workload: Workload) -> bool:
        return True

    def generate(self, batch: list[Prompt], max_new_tokens: int) -> list[dict]:
        params = [dict({"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
                       **({"json_schema": p.json_schema} if p.json_schema is not None else {})) for p in batch]
        outs = self.engine.generate(input_ids=[p.ids for p in batch], sampling_params=params)
        for prompt, out in zip(batch, outs):  # a short or aborted request would make the figure meaningless
            got, reason = out["meta_info"]["completion_tokens"], out["meta_info"]["finish_reason"]
            # Under a schema a request stops when its object is complete, but never aborts.
            ok = got == max_new_tokens if prompt.json_schema is None else (
                1 <= got <= max_new_tokens and reason["type"] != "abort")
            if not ok:
                raise RuntimeError(f"{self.name} returned {got} tokens, not {max_new_tokens}: {reason}")
        return outs

    def spec_totals(self) -> tuple[int, int] | None:
        """The engine's running (verify forwards, accepted tokens); None without speculation."""
        if not self.algorithm:
            return None
        stats = self.engine.get_server_info()["stats"]
        return stats["spec_verify_ct"], stats["spec_accepted_tokens"]

    def describe(self) -> dict | None:
        """The speculative configuration in effect (the engine's defaults filled in), with the EAGLE
        head's directory."""
        if not self.algorithm:
            return None
        desc = describe_engine(self.engine)["speculative"]
        if self.algorithm == "EAGLE":
            from specjet.models.eagle import default_eagle_path

            desc["draft_model_path"] = str(self.kwargs.get("speculative_draft_model_path") or default_eagle_path())
        return desc

    def close(self) -> None:
        self.engine.shutdown()


def describe_spec(desc: dict) -> str:
    """``SpecjetSystem.describe()`` in one line: the engine's settings, then where the drafts come from."""
    if desc["algorithm"] == "EAGLE":
        return f"{spec_str(desc)}, head {desc['draft_model_path']}"
    window = desc.get("match_window") or [None, None]
    return f"{spec_str(desc)}, match window {window[0]}-{window[1]}"


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

    def supports(self, workload: Workload) -> bool:
        return not workload.constrained  # no grammar here

    def generate(self, batch: list[Prompt], max_new_tokens: int) -> None:
        torch = self.torch
        rows = [p.ids for p in batch]
        width = max(len(ids) for ids in rows)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(ids)) + ids for ids in rows], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in rows], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                      min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.pad_token_id)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if out.shape[1] != width + max_new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {max_new_tokens}")

    def spec_totals(self) -> None:
        return None

    def close(self) -> None:
        del self.model


# ---------------------------------------------------------------- measuring
@dataclass
class Measurement:
    system: str
    workload: str
    batch_size: int
    requests: int  # per pass: num_prompts rounded up to a multiple of batch_size
    max_new_tokens: int
    t_1: list[float] = field(default_factory=list)  # seconds per pass, max_new_tokens=1
    t_n: list[float] = field(default_factory=list)  # seconds per pass, max_new_tokens=N
    decode_tokens: list[int] = field(default_factory=list)  # per N-token pass: tokens after each request's first
    verify_ct: list[int] = field(default_factory=list)  # speculative: verify forwards per N-token pass
    accepted: list[int] = field(default_factory=list)  # speculative: tokens they committed
    histogram: dict[int, int] = field(default_factory=dict)  # tokens committed per verify -> count, all passes

    @property
    def rates(self) -> list[float]:
        """Decode tokens/s of each run; NaN where noise made t_N <= t_1."""
        return [tokens / (n - one) if n > one else math.nan
                for one, n, tokens in zip(self.t_1, self.t_n, self.decode_tokens)]

    @property
    def accept_lengths(self) -> list[float]:
        return [a / v for a, v in zip(self.accepted, self.verify_ct) if v]

    @property
    def accept_length(self) -> float | None:
        """Accepted tokens / verify forwards over every timed N-token pass."""
        return sum(self.accepted) / sum(self.verify_ct) if sum(self.verify_ct) else None

    def summary(self) -> dict:
        valid = [r for r in self.rates if not math.isnan(r)]
        return {
            "median": statistics.median(valid) if valid else None,
            "min": min(valid) if valid else None,
            "max": max(valid) if valid else None,
        }

    def record(self) -> dict:
        out = {"system": self.system, "workload": self.workload, "batch_size": self.batch_size,
               "requests": self.requests, "decode_tok_s": self.summary(),
               "runs_decode_tok_s": [None if math.isnan(r) else r for r in self.rates],
               "t_1_s": self.t_1, "t_n_s": self.t_n, "decode_tokens": self.decode_tokens}
        if self.verify_ct:
            out.update(accept_length=self.accept_length, runs_accept_length=self.accept_lengths,
                       verify_ct=self.verify_ct, accepted_tokens=self.accepted,
                       accept_histogram={str(k): v for k, v in sorted(self.histogram.items())})
        return out


def make_batches(prompts: list, batch_size: int) -> list[list]:
    """The prompts, cycled up to a multiple of ``batch_size`` so every batch is full, in batches."""
    count = math.ceil(len(prompts) / batch_size) * batch_size
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    return [cycled[i:i + batch_size] for i in range(0, count, batch_size)]


def timed_pass(system, batches, max_new_tokens: int) -> tuple[float, list[dict] | None]:
    """Seconds for all batches, and specjet's results (None for HF)."""
    results = []
    start = time.perf_counter()
    for batch in batches:
        outs = system.generate(batch, max_new_tokens)
        if outs is not None:
            results.extend(outs)
    return time.perf_counter() - start, (results if results else None)


def warm_up(system, batches, max_new_tokens: int) -> None:
    """One batch with N tokens, then every batch with 1 (so each prompt's schema, if any, is compiled
    and cached before the timing, and both timed passes find the same cache)."""
    system.generate(batches[0], max_new_tokens)
    timed_pass(system, batches, 1)


def timed_run(system, batches, m: Measurement) -> list[list[int]] | None:
    """One run: the 1-token pass, then the N-token pass with the engine's speculative totals read
    around it (outside the timing). Returns the N-token pass's output ids (None for HF)."""
    n = m.max_new_tokens
    t_1, _ = timed_pass(system, batches, 1)
    before = system.spec_totals()
    t_n, outs = timed_pass(system, batches, n)
    after = system.spec_totals()
    m.t_1.append(t_1)
    m.t_n.append(t_n)
    if outs is None:
        m.decode_tokens.append(m.requests * (n - 1))
        return None
    m.decode_tokens.append(sum(o["meta_info"]["completion_tokens"] - 1 for o in outs))
    if before is not None:
        m.verify_ct.append(after[0] - before[0])
        m.accepted.append(after[1] - before[1])
        for o in outs:
            for k, count in o["meta_info"].get("spec_accept_histogram", {}).items():
                m.histogram[int(k)] = m.histogram.get(int(k), 0) + count
    return [o["output_ids"] for o in outs]


def measure(systems, workloads: list[Workload], args: argparse.Namespace):
    """Every (system, workload, batch size), runs interleaved. Returns the measurements and, per
    (system, workload, batch size), the output ids of each run's N-token pass (specjet only)."""
    from tqdm.auto import tqdm

    n = args.max_new_tokens
    batches = {(w.name, bs): make_batches(w.prompts, bs) for w in workloads for bs in args.batch_sizes}
    cells = [(w, bs, s) for w in workloads for bs in args.batch_sizes for s in systems if s.supports(w)]
    table = {(s.name, w.name, bs): Measurement(s.name, w.name, bs, sum(map(len, batches[(w.name, bs)])), n)
             for w, bs, s in cells}
    outputs: dict[tuple, list] = collections.defaultdict(list)
    with tqdm(total=len(cells) * (1 + args.repeats), unit="run", desc="bench.latency", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for w, bs, system in cells:
            bar.set_description(f"warm-up {system.name} {w.name} bs={bs}")
            warm_up(system, batches[(w.name, bs)], n)
            bar.update()
        for repeat in range(args.repeats):
            for w, bs, system in cells:
                bar.set_description(f"run {repeat + 1}/{args.repeats} {system.name} {w.name} bs={bs}")
                m = table[(system.name, w.name, bs)]
                ids = timed_run(system, batches[(w.name, bs)], m)
                if ids is not None:
                    outputs[(system.name, w.name, bs)].append(ids)
                rate = m.rates[-1]
                bar.set_postfix_str(f"{rate:.1f} tok/s" if not math.isnan(rate) else "t_N <= t_1")
                bar.update()
    return list(table.values()), dict(outputs)


def compare_outputs(outputs: dict, plain: str = PLAIN) -> dict:
    """Every other system's N-token outputs against ``plain``'s on the same workload, batch size and
    run: equal token ids, request by request."""
    passes = requests = 0
    mismatches = []
    for (system, workload, bs), runs in sorted(outputs.items()):
        if system == plain:
            continue
        reference = outputs[(plain, workload, bs)]
        for run, (got, want) in enumerate(zip(runs, reference)):
            passes += 1
            for i, (g, w) in enumerate(zip(got, want)):
                requests += 1
                if g != w:
                    position = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                    mismatches.append({"system": system, "workload": workload, "batch_size": bs, "run": run,
                                       "request": i, "first_differing_token": position})
    return {"identical": not mismatches, "passes": passes, "requests": requests,
            "mismatched_requests": len(mismatches), "mismatches": mismatches[:20]}


def identity_line(check: dict, what: str) -> str:
    if check["identical"]:
        return f"outputs identical: yes ({what}: {check['requests']} requests in {check['passes']} N-token passes)"
    first = check["mismatches"][0]
    return (f"outputs identical: NO ({what}: {check['mismatched_requests']} of {check['requests']} requests differ; "
            f"first: {first['system']} {first['workload']} bs{first['batch_size']} run {first['run'] + 1} request "
            f"{first['request']} from token {first['first_differing_token']})")


# ---------------------------------------------------------------- reporting
def _ratio(a, b):
    return a / b if a is not None and b else None


def figures(measurements: list[Measurement]) -> dict:
    """Per workload: ratios between systems at each batch size, the speculative system's accept
    length, and each system's scaling from the smallest batch size."""
    by = {(m.system, m.workload, m.batch_size): m for m in measurements}
    median = {k: m.summary()["median"] for k, m in by.items()}
    out = {}
    for workload in dict.fromkeys(m.workload for m in measurements):
        sizes = sorted({bs for (_, w, bs) in by if w == workload})
        systems = list(dict.fromkeys(s for (s, w, _) in by if w == workload))
        spec = next((s for s in systems if s.startswith(PLAIN + "+")), None)
        f = {}
        if "HF" in systems:
            f["specjet_over_hf"] = {str(bs): _ratio(median[(PLAIN, workload, bs)], median.get(("HF", workload, bs)))
                                    for bs in sizes}
            if spec:
                f["spec_over_hf"] = {str(bs): _ratio(median[(spec, workload, bs)], median.get(("HF", workload, bs)))
                                     for bs in sizes}
        if spec:
            f["speedup"] = {str(bs): _ratio(median[(spec, workload, bs)], median[(PLAIN, workload, bs)])
                            for bs in sizes}
            f["accept_length"] = {str(bs): by[(spec, workload, bs)].accept_length for bs in sizes}
        f["scaling"] = {s: {f"{bs}/{sizes[0]}": _ratio(median[(s, workload, bs)], median[(s, workload, sizes[0])])
                            for bs in sizes[1:]} for s in systems}
        out[workload] = f
    return out


def _num(x, spec=".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def header_lines(header: dict) -> list[str]:
    return report_header_lines(header["command"], header["date"], header["machine"]) + [
        f"# model: {header['model_dir']} on {header['device']}; specjet {header['specjet_dtype']}"
        + (f", HF {header['hf_dtype']}" if header.get("hf_dtype") else ""),
    ]


def workload_heading(name: str, info: dict) -> str:
    t = info["prompt_tokens"]
    return f"## {name}: {t['count']} {info['description']} ({t['min']}-{t['max']} prompt tokens, mean {t['mean']:.0f})"


def format_report(header: dict, measurements: list[Measurement], figs: dict, identity: dict | None) -> str:
    spec = header.get("speculative")
    constrained = any(w["constrained"] for w in header["workloads"].values())
    lines = header_lines(header)
    if spec:
        lines.append(f"# speculative: {header['speculative_system']} = {describe_spec(spec)}; "
                     f"{PLAIN} = the same engine without speculation")
    lines += [
        f"# N={header['max_new_tokens']} new tokens per request, greedy, EOS ignored, median of "
        f"{header['repeats']} runs interleaved (run, workload, batch size, system)",
        "# decode tok/s = " + ("decode tokens (after each request's first; fewer where a schema ends a request)"
                               if constrained else "requests * (N-1)")
        + " / (t_N - t_1), wall clock of the same batches with N and 1 new tokens",
    ]
    if spec:
        lines.append("# accept = accepted tokens / verify forwards over the timed N-token passes (engine totals)")
    for workload, f in figs.items():
        rows = [x for x in measurements if x.workload == workload]
        info = header["workloads"][workload]
        lines += ["", workload_heading(workload, info)
                  + ("; HF left out (no grammar)" if info["constrained"] and header.get("hf_dtype") else ""),
                  f"{'system':<14} {'batch':>5} {'decode tok/s':>12} {'min':>8} {'max':>8} {'t_1 s':>8} {'t_N s':>8}"
                  + (f" {'accept':>7}" if spec else "")]
        order = {PLAIN: 0, "HF": 2}
        for x in sorted(rows, key=lambda x: (x.batch_size, order.get(x.system, 1))):
            s = x.summary()
            row = (f"{x.system:<14} {x.batch_size:>5} {_num(s['median']):>12} {_num(s['min']):>8} {_num(s['max']):>8} "
                   f"{statistics.median(x.t_1):>8.3f} {statistics.median(x.t_n):>8.3f}")
            if x.accept_length is not None:
                row += f" {x.accept_length:>7.2f}"
            lines.append(row.rstrip())
        if "speedup" in f:
            name = header["speculative_system"]
            lines.append(f"speed-up {name}/{PLAIN}: " + ", ".join(f"bs{bs} {_num(r, '.2f')}x"
                                                              for bs, r in f["speedup"].items()))
            lines.append(f"accept length {name}: " + ", ".join(f"bs{bs} {_num(a, '.2f')}"
                                                             for bs, a in f["accept_length"].items()))
        if "specjet_over_hf" in f:
            lines.append("specjet/HF: " + ", ".join(f"bs{bs} {_num(r, '.2f')}x"
                                                    for bs, r in f["specjet_over_hf"].items()))
        if "spec_over_hf" in f:
            lines.append(f"{header['speculative_system']}/HF: " + ", ".join(f"bs{bs} {_num(r, '.2f')}x"
                                                                           for bs, r in f["spec_over_hf"].items()))
        for system, per_size in f["scaling"].items():
            if per_size:
                lines.append(f"scaling {system}: " + ", ".join(f"bs{k.replace('/', '/bs')} {_num(r, '.2f')}x"
                                                               for k, r in per_size.items()))
    if identity is not None:
        lines += ["", identity_line(identity, f"{header['speculative_system']} vs {PLAIN}, greedy")]
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
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
    specjet_dtype = resolve_dtype(args.dtype, device)
    hf_dtype = torch.bfloat16 if specjet_dtype == torch.bfloat16 else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workloads = load_workloads(args, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    skip_hf = args.skip_hf or args.sweep or all(w.constrained for w in workloads)  # HF has no grammar
    context = {
        "command": command, "date": date,
        "machine": machine_info(),  # before the load it describes the machine as the runs found it
        "model_dir": str(model_dir), "device": str(device),
        "specjet_dtype": str(specjet_dtype).removeprefix("torch."),
        "hf_dtype": None if skip_hf else str(hf_dtype).removeprefix("torch."),
    }
    if args.sweep:
        from bench.spec_sweep import run_sweep

        return run_sweep(args, workloads, context)

    kwargs = engine_kwargs(args)
    spec_name = f"{PLAIN}+{args.speculative_algorithm}" if args.speculative_algorithm else None
    names = [PLAIN] + ([spec_name] if spec_name else []) + ([] if skip_hf else ["HF"])
    print(f"loading {', '.join(names)} from {model_dir} ...", file=sys.stderr)
    systems = []
    try:
        systems.append(SpecjetSystem(PLAIN, without_speculation(kwargs)))
        if spec_name:
            systems.append(SpecjetSystem(spec_name, kwargs))
        if not skip_hf:
            systems.append(HFSystem(model_dir, hf_dtype, device, pad))
        spec_desc = systems[1].describe() if spec_name else None
        measurements, outputs = measure(systems, workloads, args)
    finally:
        for system in systems:
            system.close()

    header = make_header("latency", context, workloads, args)
    if spec_name:
        header.update(speculative=spec_desc, speculative_system=spec_name)
    identity = compare_outputs(outputs) if spec_name else None
    figs = figures(measurements)
    record = dict(header, args=vars(args), figures=figs, outputs_identical=identity,
                  results=[m.record() for m in measurements])
    return finish(record, format_report(header, measurements, figs, identity), args)


if __name__ == "__main__":
    main()
