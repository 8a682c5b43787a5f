"""Several engine configurations side by side, in one process and on the same requests: decode
tokens/s, accept length, and whether the outputs (greedy or seeded sampled) equal the first configuration's.

    python -m bench.compare [--configs none NGRAM:speculative_algorithm=NGRAM EAGLE:speculative_algorithm=EAGLE]
                            [--workload gsm8k|json [--json-constrained]] [--num-prompts 8] [--history-tokens 0]
                            [--batch-sizes 1 8]
                            [--max-new-tokens 64] [--repeats 3] [--chart bench/out/compare.png]
                            [--result-file bench/out/compare.jsonl] [engine flags: the base of every configuration]

A configuration is ``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE``, KEY an Engine argument (SGLang's names,
``-`` or ``_``) and VALUE an int, a float, true/false, none, or a string; it overrides the engine flags
given on the command line, which every configuration starts from. ``none`` is plain decoding
(``disable_guided_drafting=true`` unless it says otherwise: the engine's default drafts under a grammar, and on a
CPU a lone free-text request with the shipped DFlash draft); any other name alone is the command line's engine. For
example
``none: NGRAM:speculative_algorithm=NGRAM EAGLE:speculative_algorithm=EAGLE``, or
``overlap:disable_overlap_schedule=false no-overlap:disable_overlap_schedule=true``, or
``eagle-s2:speculative_algorithm=EAGLE,speculative_num_steps=2``. The first configuration is the
reference of the speed-up and identity columns.

Requests: ``--num-prompts`` chat-formatted prompts, tokenized once and sent as the same token ids to
every engine: GSM8K test questions (``--workload gsm8k``) or the prompts of
``../shared/data/jsonschema`` (``--workload json``; decoded without their schemas unless
``--json-constrained``); with ``--history-tokens N`` each after the same N-odd tokens of earlier chat
turns (a long context, as an agent's conversation has; the prefix cache holds it after the first
request, so the decode rate measures decoding over it). Every request generates exactly N = ``--max-new-tokens`` tokens greedily, EOS
ignored (under a schema a request ends where its object does, so decode tokens are counted). With
``--stop-at-eos`` a reply ends at EOS (or at N): tokens/s and acceptance over what the model answers, not
over the text a model writes past its own end, which no draft was trained on.

Decode tokens/s is measured as bench.latency measures it: the prompts are cycled up to a multiple of
the batch size B and cut into batches of B (one ``Engine.generate`` call each); a pass runs all
batches in turn; a run times the same batches twice, t_1 with max_new_tokens=1 (prefill and first
token) and t_N with N, and

    decode tokens/s = decode tokens (after each request's first) / (t_N - t_1)

so that what both passes share (prefill, scheduling, returning a request) cancels. Accept length =
accepted tokens / verify forwards over the N-token passes, from the engine's running totals read
around each pass. The table gives the median over ``--repeats`` runs with min and max. Every engine
is loaded up front and warmed up at each batch size; runs are interleaved (repeat, batch size,
configuration; the order of configurations reversed every other repeat) so that drifting load on a
shared machine hits every configuration alike.

Greedy outputs must not depend on the configuration: each N-token pass's output ids are compared,
request by request, with the first configuration's at the same batch size and repeat. A mismatch is
printed in capitals and fails the command (after the table, the chart and the record are written).

``--chart out.png`` draws decode tokens/s and accept length per configuration and batch size (needs
matplotlib: ``pip install matplotlib`` or the ``bench`` extra); ``--result-file`` appends one JSON
record (command, date, machine, arguments, configurations, every timing and the figures).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import pathlib
import statistics
import sys
from dataclasses import dataclass

from bench.common import (GSM8K_TEST, JSONSCHEMA_DIR, add_engine_args, append_jsonl, chat_history, chat_prompt,
                          command_line, compare_outputs, engine_kwargs, fmt_num, gsm8k_questions, identity_record,
                          jsonschema_prompts, machine_info, now, report_header_lines)
from bench.decode_rate import Measurement, Prompt, SpecjetSystem, make_batches, timed_run, warm_up
from bench.engine_info import describe_engine, speculation_str

DEFAULT_CONFIGS = ["none", "NGRAM:speculative_algorithm=NGRAM", "EAGLE:speculative_algorithm=EAGLE"]
NO_MATPLOTLIB = ("--chart needs matplotlib, which is not installed (pip install matplotlib, or "
                 "pip install -e '.[bench]'); the table and the record are written, the chart is not")


# ---------------------------------------------------------------- configurations
@dataclass
class Config:
    name: str
    overrides: dict  # Engine keywords this configuration sets on top of the command line's


def parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_config(spec: str) -> Config:
    """``NAME`` or ``NAME:KEY=VALUE,KEY=VALUE`` -> Config; raises ValueError naming what is wrong."""
    from specjet.engine.args import EngineArgs

    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"configuration {spec!r} has no name (NAME or NAME:KEY=VALUE,...)")
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    overrides = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"configuration {name!r}: {item!r} is not KEY=VALUE")
        if key not in known:
            raise ValueError(f"configuration {name!r}: {key!r} is not an Engine argument "
                             f"(known: {', '.join(sorted(known))})")
        overrides[key] = parse_value(value.strip())
    if name == "none":  # no speculation at all, not the engine's default (which drafts)
        overrides.setdefault("disable_guided_drafting", True)
    return Config(name, overrides)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, metavar="NAME[:KEY=VALUE,...]",
                        help=f"default: {' '.join(DEFAULT_CONFIGS)}")
    parser.add_argument("--workload", choices=["gsm8k", "json"], default="gsm8k")
    parser.add_argument("--json-constrained", action="store_true",
                        help="json workload: decode under each entry's schema (json_schema)")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts; a pass generates for all of them")
    parser.add_argument("--history-tokens", type=int, default=0, metavar="N",
                        help="put at least N tokens of earlier chat turns (GSM8K questions and solutions) before "
                             "every prompt: decoding over a long context, as in an agent's conversation")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64, help="N, tokens generated per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration and batch size")
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="a reply ends at EOS or at N (default: exactly N tokens, EOS ignored)")
    parser.add_argument("--data-path", default=str(GSM8K_TEST), help="GSM8K-style JSONL (field `question`)")
    parser.add_argument("--json-path", default=str(JSONSCHEMA_DIR), help="folder with the schemas' index.json")
    sampling = parser.add_argument_group("sampling (default: greedy); every configuration's outputs must match the "
                                         "first's, sampled ones too (a token's coin is its seed's and position's)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="> 0: draw the tokens")
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=-1)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--seed", type=int, default=0, help="request i of a batch draws with seed + i")
    parser.add_argument("--chart", default=None, metavar="PNG", help="save a chart here (needs matplotlib)")
    parser.add_argument("--result-file", default=None, help="append a JSON record to this .jsonl file")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    if not 0 <= args.temperature < math.inf:
        parser.error("--temperature must be a finite number >= 0")
    if not 0 < args.top_p <= 1 or not 0 <= args.min_p <= 1 or not (args.top_k == -1 or args.top_k >= 1):
        parser.error("--top-p must lie in (0, 1], --min-p in [0, 1], --top-k be -1 or >= 1")
    if args.temperature == 0 and (args.top_p, args.top_k, args.min_p, args.seed) != (1.0, -1, 0.0, 0):
        parser.error("--top-p, --top-k, --min-p and --seed apply to sampling: give --temperature > 0 with them")
    args.sampling = ({"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                      "seed": args.seed} if args.temperature > 0 else None)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (decode starts after the first token)")
    if args.repeats < 1 or args.num_prompts < 1 or min(args.batch_sizes) < 1:
        parser.error("--repeats, --num-prompts and --batch-sizes must be positive")
    if args.history_tokens < 0:
        parser.error("--history-tokens must not be negative")
    if args.json_constrained and args.workload != "json":
        parser.error("--json-constrained needs --workload json")
    args.batch_sizes = sorted(set(args.batch_sizes))
    try:
        args.config_list = [parse_config(c) for c in args.configs]
    except ValueError as exc:
        parser.error(str(exc))
    names = [c.name for c in args.config_list]
    if len(set(names)) != len(names):
        parser.error(f"configuration names must differ: {' '.join(names)}")
    if args.chart and importlib.util.find_spec("matplotlib") is None:
        print(f"bench.compare: {NO_MATPLOTLIB}", file=sys.stderr)
    return args


# ---------------------------------------------------------------- requests
def load_prompts(args: argparse.Namespace, tokenizer) -> tuple[list[Prompt], str]:
    """The workload's prompts, chat-formatted and tokenized once, and a description of them."""
    history = chat_history(tokenizer, args.history_tokens, args.data_path) if args.history_tokens else None
    after = f" after {len(history) // 2} earlier Q&A turns" if history else ""

    def ids(text: str) -> list[int]:
        return tokenizer(chat_prompt(tokenizer, text, history))["input_ids"]

    if args.workload == "gsm8k":
        return ([Prompt(ids(q["question"])) for q in gsm8k_questions(args.num_prompts, args.data_path)],
                f"chat-formatted GSM8K test questions{after}")
    entries = jsonschema_prompts(args.num_prompts, args.json_path)
    how = "decoded under their schemas" if args.json_constrained else "decoded without the grammar"
    return ([Prompt(ids(e["prompt"]), e["schema"] if args.json_constrained else None) for e in entries],
            f"chat-formatted JSON-schema prompts{after}, {how}")


# ---------------------------------------------------------------- measuring
def measure(systems: dict[str, SpecjetSystem], prompts: list[Prompt],
            args: argparse.Namespace) -> dict[tuple[str, int], Measurement]:
    from tqdm.auto import tqdm

    n = args.max_new_tokens
    batches = {bs: make_batches(prompts, bs) for bs in args.batch_sizes}
    cells = {(name, bs): Measurement(name, args.workload, bs, sum(map(len, batches[bs])))
             for bs in args.batch_sizes for name in systems}
    with tqdm(total=len(cells) * (1 + args.repeats), unit="run", desc="bench.compare", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for (name, bs) in cells:
            bar.set_description(f"warm-up {name} bs={bs}")
            # Every batch, as bench.latency's: a first timed pass would otherwise prefill (and, under a schema,
            # compile) the batches after the first cold in its 1-token pass and find them cached in its N-token one.
            warm_up(systems[name], batches[bs], n)
            bar.update()
        for repeat in range(args.repeats):
            order = list(systems) if repeat % 2 == 0 else list(reversed(systems))
            for bs in args.batch_sizes:
                for name in order:
                    bar.set_description(f"run {repeat + 1}/{args.repeats} {name} bs={bs}")
                    cell = cells[(name, bs)]
                    timed_run(systems[name], batches[bs], n, cell)
                    rate = cell.rates[-1]
                    bar.set_postfix_str(f"{rate:.1f} tok/s" if not math.isnan(rate) else "t_N <= t_1")
                    bar.update()
    return cells


def identity_check(cells: dict[tuple[str, int], Measurement], reference: str) -> dict:
    """Every configuration's N-token outputs against ``reference``'s at the same batch size and
    repeat, request by request."""
    return compare_outputs({key: cell.outputs for key, cell in cells.items()}, reference, ("config", "batch_size"))


# ---------------------------------------------------------------- reporting
def identical_cell(identity: dict, name: str, bs: int) -> str:
    if name == identity["reference"]:
        return "reference"
    c = identity["per_cell"][(name, bs)]
    return "yes" if c["differing"] == 0 else f"NO ({c['differing']}/{c['requests']})"


def result_rows(cells: dict[tuple[str, int], Measurement], identity: dict) -> list[dict]:
    reference = identity["reference"]
    rows = []
    for (name, bs), cell in cells.items():
        summary = cell.summary()
        median, ref = summary["median"], cells[(reference, bs)].summary()["median"]
        rows.append({
            "config": name, "batch_size": bs, "requests": cell.requests, "decode_tok_s": summary,
            "runs_decode_tok_s": [None if math.isnan(r) else r for r in cell.rates],
            "t_1_s": cell.t_1, "t_n_s": cell.t_n, "decode_tokens": cell.decode_tokens,
            "accept_length": cell.accept_length, "verify_ct": cell.verify_ct, "accepted_tokens": cell.accepted,
            "speedup": median / ref if median is not None and ref else None,
            "identical": identical_cell(identity, name, bs),
            "spec_phases_ms": cell.record().get("spec_phases_ms"),
            "plain_iteration_ms": cell.record().get("plain_iteration_ms"),
            "tree_nodes": cell.record().get("tree_nodes"),
        })
    return sorted(rows, key=lambda r: r["batch_size"])  # stable: configurations keep their order


def decoding_str(sampling: dict | None) -> str:
    if not sampling:
        return "greedy"
    return "sampled (" + ", ".join(f"{k}={v}" for k, v in sampling.items()) + ")"


def identity_line(identity: dict, names: list[str]) -> str:
    others = ", ".join(n for n in names if n != identity["reference"])
    if not others:
        return "outputs identical: n/a (one configuration)"
    if identity["identical"]:
        return (f"outputs identical: yes ({others} vs {identity['reference']}: "
                f"{identity['requests']} requests compared)")
    first = identity["mismatches"][0]
    return (f"!!! OUTPUTS DIFFER: {identity['mismatched_requests']} of {identity['requests']} requests are not "
            f"identical to {identity['reference']}'s; first: {first['config']} bs{first['batch_size']} run "
            f"{first['run'] + 1} request {first['request']} from token {first['first_differing_token']} !!!")


def format_report(header: dict, rows: list[dict], identity: dict) -> str:
    lines = report_header_lines(header["command"], header["date"], header["machine"])
    lines.append(f"# model: {header['model_dir']}")
    for c in header["configs"]:
        e = c["engine"]
        loop = {True: ", overlap loop", False: ", plain loop"}.get(e.get("overlap_schedule"), "")
        lines.append(f"# config {c['name']}: {e['dtype']} on {e['device']}{loop}, speculative {speculation_str(e)}"
                     + (f"; set: {', '.join(f'{k}={v}' for k, v in c['overrides'].items())}" if c["overrides"] else ""))
    t = header["prompt_tokens"]
    lines += [
        f"# {t['count']} {header['workload_description']} ({t['min']}-{t['max']} prompt tokens, mean {t['mean']:.0f}); "
        f"N={header['max_new_tokens']} new tokens per request, {decoding_str(header.get('sampling'))}, "
        f"{'each reply ending at EOS or N' if header.get('stop_at_eos') else 'EOS ignored'}; "
        f"median of {header['repeats']} runs",
        "# decode tok/s = decode tokens / (t_N - t_1), wall clock of the same batches with N and 1 new tokens; "
        "accept = accepted tokens / verify forwards; speed-up and identical: against "
        f"{header['configs'][0]['name']} at the same batch size",
        "",
    ]
    width = max(8, *(len(r["config"]) for r in rows))
    lines.append(f"{'config':<{width}} {'batch':>5} {'decode tok/s':>12} {'min':>8} {'max':>8} {'t_1 s':>8} "
                 f"{'t_N s':>8} {'accept':>7} {'speed-up':>8}  identical")
    for r in rows:
        d = r["decode_tok_s"]
        lines.append(f"{r['config']:<{width}} {r['batch_size']:>5} {fmt_num(d['median']):>12} "
                     f"{fmt_num(d['min']):>8} {fmt_num(d['max']):>8} {statistics.median(r['t_1_s']):>8.3f} "
                     f"{statistics.median(r['t_n_s']):>8.3f} {fmt_num(r['accept_length'], '.2f'):>7} "
                     f"{fmt_num(r['speedup'], '.2f') + 'x':>8}  {r['identical']}")
    phased = [r for r in rows if r.get("spec_phases_ms")]
    if phased:  # where a speculative iteration's time goes (spec_v2/speculator.py PhaseTimings)
        lines += ["", "# ms per speculative iteration, by phase (median over runs of each run's mean)",
                  f"{'config':<{width}} {'batch':>5} {'grammar':>8} {'draft':>8} {'verify':>8} {'extend':>8} {'total':>8}"
                  f" {'nodes':>6}"]
        for r in phased:  # nodes: of one request's verify tree, root included (a CPU verify's cost grows with them)
            p = r["spec_phases_ms"]
            lines.append(f"{r['config']:<{width}} {r['batch_size']:>5} {p['grammar_ms']:>8.2f} {p['draft_ms']:>8.2f} "
                         f"{p['verify_ms']:>8.2f} {p['draft_extend_ms']:>8.2f} {sum(p.values()):>8.2f} "
                         f"{fmt_num(r.get('tree_nodes'), '.1f'):>6}")
    plain = [r for r in rows if r.get("plain_iteration_ms")]
    if plain:  # what a plain decode iteration costs beyond its model forward (issue 16, item 5)
        lines += ["", "# plain decoding: ms per decode iteration (compute + the compute side's wait for the host) and "
                  "its model forward, medians",
                  f"{'config':<{width}} {'batch':>5} {'iteration':>9} {'forward':>8} {'ratio':>6}"]
        for r in plain:
            it = r["plain_iteration_ms"]
            lines.append(f"{r['config']:<{width}} {r['batch_size']:>5} {it['iteration_ms_median']:>9.2f} "
                         f"{it['forward_ms_median']:>8.2f} {it['iteration_ms_median'] / it['forward_ms_median']:>6.2f}")
    lines += ["", identity_line(identity, [c["name"] for c in header["configs"]])]
    return "\n".join(lines)


def save_chart(path: str, rows: list[dict], title: str) -> None:
    """Grouped bars per batch size: decode tok/s (left) and accept length (right; speculative only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["config"] for r in rows))
    sizes = sorted({r["batch_size"] for r in rows})
    by = {(r["config"], r["batch_size"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / len(names)
    for panel, (ax, label) in enumerate(zip(axes, ["decode tokens/s (median)", "accept length"])):
        for k, name in enumerate(names):
            xs, ys = [], []
            for j, bs in enumerate(sizes):
                r = by[(name, bs)]
                y = r["decode_tok_s"]["median"] if panel == 0 else r["accept_length"]
                if y is not None:
                    xs.append(j + (k - (len(names) - 1) / 2) * width)
                    ys.append(y)
            bars = ax.bar(xs, ys, width, label=name)
            ax.bar_label(bars, fmt="%.1f" if panel == 0 else "%.2f", fontsize=7)
        ax.set_xticks(range(len(sizes)), [f"batch {bs}" for bs in sizes])
        ax.set_title(label)
    axes[1].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")  # plain decoding: one token per forward
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command, date, machine = command_line(), now(), machine_info()

    from specjet.models.weights import resolve_model_path

    base = engine_kwargs(args)
    model_dir = resolve_model_path(args.model_path)
    systems = {}
    try:
        for config in args.config_list:
            kwargs = dict(base, **config.overrides)
            print(f"loading {config.name}: Engine({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) ...",
                  file=sys.stderr)
            try:
                systems[config.name] = SpecjetSystem(config.name, kwargs, args.sampling, args.stop_at_eos)
            except (TypeError, ValueError, NotImplementedError, FileNotFoundError) as exc:
                raise SystemExit(f"bench.compare: configuration {config.name!r} cannot be loaded: {exc}") from None
        first = systems[args.config_list[0].name]
        prompts, description = load_prompts(args, first.engine.tokenizer)
        cells = measure(systems, prompts, args)
        for system in systems.values():  # every workload ends with no KV slot leaked
            system.engine.check_kv_invariant()
        configs = [{"name": c.name, "overrides": c.overrides, "engine_kwargs": dict(base, **c.overrides),
                    "engine": describe_engine(systems[c.name].engine)} for c in args.config_list]
    finally:
        for system in systems.values():
            system.close()

    # Sampled outputs must agree too: request i draws with seed + i in every configuration, and a token's coin is a
    # function of the seed and its position (specjet/kernels/coins.py), not of how a configuration drafts.
    identity = identity_check(cells, args.config_list[0].name)
    rows = result_rows(cells, identity)
    lengths = [len(p.ids) for p in prompts]
    header = {"benchmark": "compare", "record_version": 1, "command": command, "date": date,
              "machine": dict(machine, load_avg_after=machine_info()["load_avg"]), "model_dir": str(model_dir),
              "configs": configs, "workload": args.workload, "workload_description": description,
              "prompt_tokens": {"count": len(lengths), "min": min(lengths), "max": max(lengths),
                                "mean": sum(lengths) / len(lengths)},
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "batch_sizes": args.batch_sizes,
              "sampling": args.sampling, "stop_at_eos": args.stop_at_eos}
    print(format_report(header, rows, identity), flush=True)
    if not identity["identical"]:
        print(identity_line(identity, [c["name"] for c in configs]), file=sys.stderr)

    chart = None
    if args.chart:
        if importlib.util.find_spec("matplotlib") is None:
            print(f"# chart: not written: {NO_MATPLOTLIB}", flush=True)
        else:
            save_chart(args.chart, rows, f"{description}, N={args.max_new_tokens}, {decoding_str(args.sampling)} ({date})")
            chart = args.chart
            print(f"# chart: {chart}", flush=True)
    record = dict(header, args={k: v for k, v in vars(args).items() if k != "config_list"}, results=rows,
                  outputs_identical=identity_record(identity), chart=chart)
    if args.result_file:
        append_jsonl(args.result_file, record)
        print(f"# appended to {args.result_file}", flush=True)
    if not identity["identical"]:
        raise SystemExit("bench.compare: outputs differ between configurations (see above)")
    return record


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
