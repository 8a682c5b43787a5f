"""Schema-valid JSON over the dev set of JSON schemas: validity rate, TTFT, TPOT, output tokens/s and
accept length per engine configuration, beside unconstrained decoding of the same prompts.

    python -m bench.json [--schema-dir ../shared/data/jsonschema] [--num-schemas N] [--max-new-tokens 512]
                         [--algorithms none default EAGLE EAGLE-GA] [--overlap on off] [--batch-sizes 1 4]
                         [--skip-unconstrained] [--repeats 1] [--result-file bench/out/json.jsonl]
                         [engine flags: --dtype bfloat16 --speculative-num-steps 4 ...]

Configurations: every ``--algorithms`` entry with every ``--overlap`` setting, one Engine each (loaded
in turn, warmed up once, reused for every batch size, shut down before the next is loaded):

    none        no speculation (plain decoding: disable_guided_drafting=True)
    default     the engine without speculative_algorithm, as Engine() runs: its constrained requests draft
                NGRAM trees of the grammar's forced text and their own n-grams (guided drafting)
    EAGLE       speculative_algorithm=EAGLE, speculative_grammar_aware=False (drafts ignore the grammar)
    EAGLE-GA    speculative_algorithm=EAGLE, speculative_grammar_aware=True (grammar-aware drafting)
    NGRAM, NGRAM-GA   the same with n-gram drafting
    EAGLE-HEAD-GA     EAGLE-GA with the head's trees alone (speculative_hybrid_ngram_tokens=0; by default
                      EAGLE trees also hold the best n-gram continuation)
    DFLASH, DFLASH-GA DFlash block drafting without / with grammar-aware blocks
    overlap on / off  disable_overlap_schedule=False / True

The other engine flags (``--dtype``, ``--speculative-num-steps``, ``--speculative-draft-model-path``, ...)
apply to every configuration where they mean something; ``--speculative-algorithm``,
``--speculative-grammar-aware`` and ``--disable-overlap-schedule`` are the axes above and are refused.

Requests: the ``prompt`` of each of the first ``--num-schemas`` entries of ``--schema-dir``/index.json
(all by default; or of the entries at ``--schema-indices``), as one user turn in the engine's chat template, with the entry's schema file as
``json_schema``; greedy, at most ``--max-new-tokens``, ending where the grammar ends the object. At
batch size B, B requests are in flight at once (``async_generate`` under a capacity limiter) until
all are answered. The no-spec engine (the first ``--overlap`` setting) also runs the same prompts
*unconstrained* (no ``json_schema``) at every batch size, the baseline of the "x uncon." column. The
unconstrained run is length-matched: each request decodes exactly as many tokens as it did in that
engine's constrained run just before (``max_new_tokens`` = that count, ``ignore_eos``), so the ratio
compares the same work with and without the grammar (left free, an unconstrained request writes on
past the object's end to ``--max-new-tokens`` and changes the batch's shape, not the grammar's cost).
With ``--repeats R`` every timed run is made R times in a row at each batch size (on the baseline
engine: constrained, unconstrained, constrained, unconstrained, ...), so each constrained run has an
unconstrained twin run right after it on a machine whose load drifts.

Warm-up, per engine, outside every figure: every request once with max_new_tokens=1 (so the timed
runs find each schema compiled in the engine's grammar cache: compiling is not in TTFT) and one
request of 16 tokens.

Figures, per configuration and batch size:

    valid      requests whose text parses with json.loads and validates with jsonschema against the
               entry's schema (its $schema draft; "format" is an annotation, not asserted) / requests
               that completed (all but the aborted). Under a grammar, non-JSON means cut off at
               --max-new-tokens.
    aborted    requests the engine gave up on (finish_reason "abort"): counted apart, not in "valid".
    TTFT       median over requests of meta_info ttft (submission to first token), ms
    TPOT       median over requests of (e2e_latency - ttft) / (completion_tokens - 1), ms
    out tok/s  all completion tokens / wall time of the run (first request sent to last answer back)
    accept     accepted tokens / verify forwards over the runs (the engine's totals), speculative only
    acc. done  the same over the requests that completed their object (finish "stop"), per request:
               (completion tokens - 1) / its verify forwards, pooled. A request cut at
               --max-new-tokens is often one looping over a repeated array, which speculation
               predicts far better than a real object, so "accept" alone can flatter.
    nodes      the mean nodes of a request's verify tree, root included (the engine's
               spec_phases), speculative only: a CPU verify's cost grows with them
    x uncon.   out tok/s / the unconstrained run's at the same batch size; with --repeats, the
               median over repeats of run i / unconstrained run i (TTFT, TPOT, out tok/s: the
               median over repeats). The goal line adds the same ratio by the process's CPU time
               per output token (unconstrained's / constrained's), which a VM's stolen time does
               not inflate as it does wall time
    identical  output ids equal, request by request, to the reference (the first no-spec configuration)
               at the same batch size: greedy speculation and overlap scheduling are lossless

The table goes to stdout, with a line for the goal "no-spec constrained >= 0.95x unconstrained output
tok/s at batch size 4"; ``--result-file`` appends one JSON record (command, date, machine, arguments,
configurations, figures, and each request's text and outcome). Outputs that differ from the reference
fail the command after everything is printed and written.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass, field

from bench.common import (JSONSCHEMA_DIR, add_engine_args, append_jsonl, command_line, compare_outputs,
                          default_speculation, engine_kwargs, fmt_num, generate_all, identity_record,
                          jsonschema_prompts, machine_info, now, report_header_lines)
from bench.compare import identical_cell, identity_line
from bench.engine_info import describe_engine, speculation_str, spec_totals, tree_nodes_since_reset

# --algorithms name -> the Engine keywords it sets (the other speculative flags come from the command line)
ALGORITHMS = {
    "none": {"disable_guided_drafting": True},
    "default": {},
    "EAGLE": {"speculative_algorithm": "EAGLE", "speculative_grammar_aware": False},
    "EAGLE-GA": {"speculative_algorithm": "EAGLE", "speculative_grammar_aware": True},
    "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_grammar_aware": False},
    "NGRAM-GA": {"speculative_algorithm": "NGRAM", "speculative_grammar_aware": True},
    # EAGLE-GA with the trained head's trees alone (no n-gram nodes merged in: EAGLE-2 as SGLang runs it)
    "EAGLE-HEAD-GA": {"speculative_algorithm": "EAGLE", "speculative_grammar_aware": True,
                      "speculative_hybrid_ngram_tokens": 0},
    "DFLASH": {"speculative_algorithm": "DFLASH", "speculative_grammar_aware": False},
    "DFLASH-GA": {"speculative_algorithm": "DFLASH", "speculative_grammar_aware": True},
}
OVERLAP = {"on": False, "off": True}  # --overlap value -> disable_overlap_schedule
AXIS_FLAGS = ("speculative_algorithm", "speculative_grammar_aware", "disable_overlap_schedule")
UNCONSTRAINED = "unconstrained"
GOAL = (4, 0.95)  # no-spec constrained output tok/s >= 0.95x unconstrained at batch size 4
WARMUP_TOKENS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.json", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schema-dir", default=str(JSONSCHEMA_DIR),
                        help="folder with index.json (entries under `schemas` with `file` and `prompt`)")
    parser.add_argument("--num-schemas", type=int, default=None, help="the first N entries (default: all)")
    parser.add_argument("--schema-indices", type=int, nargs="+", default=None,
                        help="only these entries (0-based positions in index.json), e.g. the schemas a draft head "
                             "never saw in training: 4 9 14 ... 49 for the packaged head")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS),
                        default=["none", "default", "EAGLE", "EAGLE-GA"])
    parser.add_argument("--overlap", nargs="+", choices=list(OVERLAP), default=["on", "off"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4], help="requests in flight at once")
    parser.add_argument("--skip-unconstrained", action="store_true", help="no unconstrained baseline runs")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per configuration and batch size (figures: medians over them)")
    parser.add_argument("--result-file", default=None, help="append a JSON record to this .jsonl file")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    axis = [f"--{name.replace('_', '-')}" for name in AXIS_FLAGS if getattr(args, name) is not None]
    if axis:
        parser.error(f"{', '.join(axis)}: set per configuration here; use --algorithms and --overlap")
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (TPOT needs a token after the first)")
    if min(args.batch_sizes) < 1 or (args.num_schemas is not None and args.num_schemas < 1) or args.repeats < 1:
        parser.error("--batch-sizes, --num-schemas and --repeats must be positive")
    if args.schema_indices is not None and args.num_schemas is not None:
        parser.error("give --num-schemas or --schema-indices, not both")
    if not (pathlib.Path(args.schema_dir) / "index.json").is_file():
        parser.error(f"--schema-dir {args.schema_dir} has no index.json")
    args.algorithms = list(dict.fromkeys(args.algorithms))
    args.overlap = list(dict.fromkeys(args.overlap))
    args.batch_sizes = sorted(set(args.batch_sizes))
    return args


# ---------------------------------------------------------------- configurations
@dataclass
class Config:
    algorithm: str  # a key of ALGORITHMS
    overlap: str  # a key of OVERLAP

    @property
    def name(self) -> str:
        return f"{self.algorithm}/{self.overlap}"

    def engine_kwargs(self, base: dict) -> dict:
        kwargs = default_speculation(base) if self.algorithm in ("none", "default") else dict(base)
        return dict(kwargs, **ALGORITHMS[self.algorithm], disable_overlap_schedule=OVERLAP[self.overlap])


def configurations(args: argparse.Namespace) -> list[Config]:
    return [Config(a, o) for a in args.algorithms for o in args.overlap]


def reference_config(configs: list[Config]) -> Config:
    """What every configuration's outputs are compared with: the first no-spec one (else the first)."""
    return next((c for c in configs if c.algorithm == "none"), configs[0])


# ---------------------------------------------------------------- validity
def load_validator(schema: str | dict):
    """A jsonschema validator for the schema, of its own ``$schema`` draft (2020-12 when it names none)."""
    import jsonschema

    schema = json.loads(schema) if isinstance(schema, str) else schema
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def check_output(output: dict, validator) -> tuple[str, str | None]:
    """(status, why): "aborted" (finish_reason abort: the engine gave up on the request), "not_json"
    (``json.loads`` fails), "invalid" (it parses but breaks the schema) or "valid" (why: None)."""
    reason = output["meta_info"]["finish_reason"] or {}
    if reason.get("type") == "abort":
        return "aborted", reason.get("message")
    try:
        instance = json.loads(output["text"])
    except ValueError as exc:
        return "not_json", f"{exc} (finish {reason.get('type')})"
    import jsonschema

    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is not None:
        return "invalid", f"{error.message} at {error.json_path}"
    return "valid", None


def request_outcomes(entries: list[dict], outputs: list[dict], validators: list) -> list[dict]:
    """Per request: schema name, ``check_output`` status and why, text, completion tokens, finish type,
    and for speculative engines its verify forwards (``spec_verify_ct``; accept length = tokens / that)."""
    outcomes = []
    for entry, out, validator in zip(entries, outputs, validators, strict=True):
        status, why = check_output(out, validator)
        m = out["meta_info"]
        outcomes.append({"schema": entry["name"], "status": status, "why": why, "text": out["text"],
                         "completion_tokens": m["completion_tokens"], "finish": (m["finish_reason"] or {}).get("type"),
                         "spec_verify_ct": m.get("spec_verify_ct")})
    return outcomes


def validity(statuses: list[str]) -> dict:
    """Counts of each ``check_output`` status, and the rate valid / completed (aborted left out)."""
    counts = {s: statuses.count(s) for s in ("valid", "invalid", "not_json", "aborted")}
    completed = len(statuses) - counts["aborted"]
    return dict(counts, requests=len(statuses), completed=completed,
                validity=counts["valid"] / completed if completed else None)


# ---------------------------------------------------------------- timing figures
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def latency_figures(outputs: list[dict], wall_s: float, cpu_s: float | None = None) -> dict:
    """Median TTFT and TPOT (ms) over the requests that have them, and output tokens/s of the run."""
    ttfts, tpots = [], []
    for o in outputs:
        m = o["meta_info"]
        if m["ttft"] is None:
            continue
        ttfts.append(m["ttft"])
        if m["completion_tokens"] >= 2:
            tpots.append((m["e2e_latency"] - m["ttft"]) / (m["completion_tokens"] - 1))
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    ttft, tpot = _median(ttfts), _median(tpots)
    return {"ttft_ms": None if ttft is None else 1000 * ttft, "tpot_ms": None if tpot is None else 1000 * tpot,
            "output_tok_s": tokens / wall_s, "completion_tokens": tokens, "wall_s": wall_s,
            "cpu_ms_per_token": 1000 * cpu_s / tokens if cpu_s is not None and tokens else None}


# ---------------------------------------------------------------- running
@dataclass
class Cell:
    """One configuration (or the unconstrained baseline) at one batch size."""
    config: str
    batch_size: int
    constrained: bool
    repeat: int = 0
    outputs: list[dict] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float | None = None  # the process's CPU time over the run (all threads)
    spec_before: tuple[int, int] | None = None
    spec_after: tuple[int, int] | None = None
    tree_nodes: float | None = None  # the mean nodes of a request's verify tree over the run, root included


def sampling_params(entries: list[dict], max_new_tokens: int, constrained: bool,
                    lengths: list[int] | None = None) -> list[dict]:
    """Greedy requests; with ``lengths`` (unconstrained, length-matched) request i decodes exactly
    ``lengths[i]`` tokens."""
    base = {"temperature": 0, "max_new_tokens": max_new_tokens}
    if lengths is not None:
        return [dict(base, max_new_tokens=max(1, n), ignore_eos=True) for n in lengths]
    return [dict(base, json_schema=e["schema"]) if constrained else dict(base) for e in entries]


def warm_up(engine, prompts: list[str], entries: list[dict], unconstrained: bool) -> None:
    """Compile every schema (one token each) and take one short request through decoding."""
    engine.generate(prompts, sampling_params(entries, 1, True))
    engine.generate(prompts[0], sampling_params(entries[:1], WARMUP_TOKENS, True)[0])
    if unconstrained:
        engine.generate(prompts[0], sampling_params(entries[:1], WARMUP_TOKENS, False)[0])


def concurrent_run(engine, cell: Cell, prompts: list[str], entries: list[dict], max_new_tokens: int, bar,
                   lengths: list[int] | None = None) -> Cell:
    """Every prompt once, ``cell.batch_size`` requests in flight, into ``cell``: the outputs, the wall
    and CPU time of the whole run and the speculative totals around it."""
    params = sampling_params(entries, max_new_tokens, cell.constrained, lengths)
    cell.spec_before = spec_totals(engine)
    tree_nodes_since_reset(engine, reset=True)  # the run's trees alone below
    start, cpu_start = time.perf_counter(), time.process_time()
    cell.outputs = generate_all(engine, prompts, params, cell.batch_size, bar)
    cell.wall_s = time.perf_counter() - start
    cell.cpu_s = time.process_time() - cpu_start
    cell.spec_after = spec_totals(engine)
    cell.tree_nodes = tree_nodes_since_reset(engine)
    return cell


def run_all(configs: list[Config], base: dict, entries: list[dict], args: argparse.Namespace):
    """Each configuration's engine in turn: load, warm up, run every batch size (and, on the baseline
    engine, the unconstrained runs). Returns the cells, the configurations' descriptions and the
    baseline configuration (None without unconstrained runs)."""
    import specjet
    from tqdm.auto import tqdm

    baseline = None if args.skip_unconstrained else next((c for c in configs if c.algorithm == "none"), None)
    runs = len(args.batch_sizes) * (len(configs) + (baseline is not None)) * args.repeats
    cells, described, prompts = [], [], None
    with tqdm(total=runs * len(entries), unit="req", desc="bench.json", file=sys.stderr, dynamic_ncols=True) as bar:
        for config in configs:
            kwargs = config.engine_kwargs(base)
            bar.set_description(f"loading {config.name}")
            try:
                engine = specjet.Engine(**kwargs)
            except (TypeError, ValueError, NotImplementedError, FileNotFoundError) as exc:
                raise SystemExit(f"bench.json: configuration {config.name} cannot be loaded: {exc}") from None
            try:
                if prompts is None:
                    prompts = [engine.apply_chat_template(e["prompt"]) for e in entries]
                bar.set_description(f"warm-up {config.name}")
                warm_up(engine, prompts, entries, config is baseline)
                for bs in args.batch_sizes:
                    for repeat in range(args.repeats):
                        bar.set_description(f"{config.name} bs={bs} run {repeat + 1}/{args.repeats}")
                        constrained = concurrent_run(engine, Cell(config.name, bs, True, repeat), prompts,
                                                     entries, args.max_new_tokens, bar)
                        cells.append(constrained)
                        if config is baseline:  # the same work without the grammar (length-matched)
                            bar.set_description(f"{UNCONSTRAINED} bs={bs} run {repeat + 1}/{args.repeats}")
                            lengths = [o["meta_info"]["completion_tokens"] for o in constrained.outputs]
                            cells.append(concurrent_run(engine, Cell(UNCONSTRAINED, bs, False, repeat), prompts,
                                                        entries, args.max_new_tokens, bar, lengths))
                engine.check_kv_invariant()  # a configuration that leaks KV must not pass for a fast one
                desc = describe_engine(engine)
                desc.update(speculative_grammar_aware=engine.args.speculative_grammar_aware)
                described.append({"name": config.name, "algorithm": config.algorithm, "overlap": config.overlap,
                                  "engine_kwargs": kwargs, "engine": desc})
            finally:
                engine.shutdown()
    return cells, described, baseline


# ---------------------------------------------------------------- comparing
def identity_check(cells: list[Cell], reference: str) -> dict:
    """Each constrained cell's output ids against the reference configuration's at the same batch
    size and repeat, request by request (bench.compare's check: per (configuration, batch size) the
    requests compared and differing, and the first mismatches)."""
    by: dict[tuple[str, int], list] = {}
    for c in sorted((c for c in cells if c.constrained), key=lambda c: c.repeat):
        by.setdefault((c.config, c.batch_size), []).append([o["output_ids"] for o in c.outputs])
    return compare_outputs(by, reference, ("config", "batch_size"))


# ---------------------------------------------------------------- reporting
def result_rows(cells: list[Cell], entries: list[dict], validators: list, identity: dict) -> list[dict]:
    """One row per configuration (and the unconstrained baseline) and batch size, its repeats folded:
    validity from the first repeat (greedy: every repeat writes the same), timings as medians."""
    groups: dict[tuple[str, int, bool], list[Cell]] = {}
    for cell in sorted(cells, key=lambda c: c.repeat):
        groups.setdefault((cell.config, cell.batch_size, cell.constrained), []).append(cell)
    uncon = {bs: [latency_figures(c.outputs, c.wall_s, c.cpu_s) for c in runs]
             for (_, bs, constrained), runs in groups.items() if not constrained}
    rows = []
    for (name, bs, constrained), runs in groups.items():
        outcomes = request_outcomes(entries, runs[0].outputs, validators)
        per_run = [latency_figures(c.outputs, c.wall_s, c.cpu_s) for c in runs]
        ratios = cpu_ratios = None
        if constrained and bs in uncon:
            ratios = [f["output_tok_s"] / base["output_tok_s"] for f, base in zip(per_run, uncon[bs])]
            cpu_ratios = [base["cpu_ms_per_token"] / f["cpu_ms_per_token"] for f, base in zip(per_run, uncon[bs])
                          if f["cpu_ms_per_token"] and base["cpu_ms_per_token"]]
        verify = accepted = None
        if runs[0].spec_before is not None:
            verify = sum(c.spec_after[0] - c.spec_before[0] for c in runs)
            accepted = sum(c.spec_after[1] - c.spec_before[1] for c in runs)
        rows.append(dict(
            config=name, batch_size=bs, constrained=constrained, repeats=len(runs),
            **validity([o["status"] for o in outcomes]), **median_figures(per_run),
            accept_length=accepted / verify if verify else None,
            accept_completed=completed_accept_length(outcomes), spec_verify_ct=verify,
            tree_nodes=_median([c.tree_nodes for c in runs if c.tree_nodes is not None]),
            vs_unconstrained=_median(ratios) if ratios else None, vs_unconstrained_runs=ratios,
            vs_unconstrained_cpu=_median(cpu_ratios) if cpu_ratios else None,
            runs=per_run, identical=identical_cell(identity, name, bs) if constrained else None,
            finish_reasons=dict(collections.Counter(o["finish"] for o in outcomes)), per_request=outcomes))
    order = {name: i for i, name in enumerate(constrained_names(rows))}  # the unconstrained row last
    return sorted(rows, key=lambda r: (r["batch_size"], order.get(r["config"], len(order))))


def median_figures(per_run: list[dict]) -> dict:
    """``latency_figures`` of several runs of the same requests: each figure's median over the runs
    (completion tokens: the first run's; greedy runs write the same)."""
    out = {key: _median([f[key] for f in per_run if f[key] is not None])
           for key in ("ttft_ms", "tpot_ms", "output_tok_s", "wall_s", "cpu_ms_per_token")}
    return dict(out, completion_tokens=per_run[0]["completion_tokens"])


def completed_accept_length(outcomes: list[dict]) -> float | None:
    """Accept length over the requests that completed their object: tokens after the first (which
    the prefill samples) / verify forwards, pooled over those requests (None: none completed, or no
    speculation)."""
    done = [o for o in outcomes if o["finish"] == "stop" and o["spec_verify_ct"]]
    verifies = sum(o["spec_verify_ct"] for o in done)
    return sum(o["completion_tokens"] - 1 for o in done) / verifies if verifies else None


def constrained_names(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["config"] for r in rows if r["constrained"]))


def table_lines(rows: list[dict]) -> list[str]:
    width = max(12, *(len(r["config"]) for r in rows))
    lines = [f"{'config':<{width}} {'batch':>5} {'valid':>6} {'invalid':>7} {'non-JSON':>8} {'aborted':>7} "
             f"{'TTFT ms':>8} {'TPOT ms':>8} {'out tok/s':>9} {'accept':>6} {'acc. done':>9} {'nodes':>5} {'x uncon.':>8}"
             "  identical"]
    for r in rows:
        ratio = "-" if r["vs_unconstrained"] is None else f"{r['vs_unconstrained']:.2f}x"
        accept = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        done = "-" if r["accept_completed"] is None else f"{r['accept_completed']:.2f}"
        nodes = "-" if r["tree_nodes"] is None else f"{r['tree_nodes']:.1f}"
        # An unconstrained run is length-matched, not meant to end its object: no validity to show.
        valid = fmt_num(r["validity"], ".3f") if r["constrained"] else "-"
        lines.append(f"{r['config']:<{width}} {r['batch_size']:>5} {valid:>6} {r['invalid']:>7} "
                     f"{r['not_json']:>8} {r['aborted']:>7} {fmt_num(r['ttft_ms']):>8} {fmt_num(r['tpot_ms']):>8} "
                     f"{fmt_num(r['output_tok_s']):>9} {accept:>6} {done:>9} {nodes:>5} {ratio:>8}  {r['identical'] or '-'}")
    return lines


def goal_line(rows: list[dict]) -> str | None:
    """The no-spec constrained configurations against the goal, where the run has its batch size."""
    bs, target = GOAL
    cells = [r for r in rows if r["constrained"] and r["batch_size"] == bs and r["config"].startswith("none/")
             and r["vs_unconstrained"] is not None]
    if not cells:
        return None
    def runs(r: dict) -> str:
        ratios = r["vs_unconstrained_runs"]
        return f" (median of {' '.join(f'{x:.2f}' for x in ratios)})" if len(ratios) > 1 else ""

    def cpu(r: dict) -> str:
        return "" if r["vs_unconstrained_cpu"] is None else f"; by CPU time per token {r['vs_unconstrained_cpu']:.2f}x"

    verdicts = ", ".join(f"{r['config']} {r['vs_unconstrained']:.2f}x{runs(r)} "
                         f"{'met' if r['vs_unconstrained'] >= target else 'NOT met'}{cpu(r)}" for r in cells)
    return f"goal: no-spec constrained >= {target}x unconstrained out tok/s at batch {bs}: {verdicts}"


def format_report(header: dict, rows: list[dict], identity: dict) -> str:
    lines = report_header_lines(header["command"], header["date"], header["machine"])
    lines.append(f"# model: {header['model_dir']}")
    for c in header["configs"]:
        e = c["engine"]
        ga = f", grammar-aware {e['speculative_grammar_aware']}" if e["speculative"] else ""
        lines.append(f"# config {c['name']}: {e['dtype']} on {e['device']}, speculative {speculation_str(e)}"
                     f"{ga}, overlap {'on' if e['overlap_schedule'] else 'off'}")
    t = header["prompt_tokens"]
    lines += [
        f"# {t['count']} schemas of {header['schema_dir']} ({t['min']}-{t['max']} prompt tokens, chat template), "
        f"json_schema, greedy, at most {header['max_new_tokens']} new tokens; batch = requests in flight"
        + (f"; {UNCONSTRAINED} = {header['baseline']} without json_schema" if header["baseline"] else ""),
        "# valid = schema-valid / completed (aborted apart); TTFT, TPOT medians over requests; out tok/s = "
        "completion tokens / wall time; accept = accepted tokens / verify forwards; acc. done = the same over "
        "the requests that completed their object; nodes = a request's verify tree, root included, mean"
        + (f"; timings: medians of {header['repeats']} runs" if header["repeats"] > 1 else ""),
        "",
    ]
    lines += table_lines(rows)
    goal = goal_line(rows)
    lines += [""] + ([goal] if goal else []) + [identity_line(identity, constrained_names(rows))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command, date, machine = command_line(), now(), machine_info()
    try:
        import jsonschema  # noqa: F401  (checked before any engine loads)
    except ImportError:
        raise SystemExit("bench.json: needs jsonschema (pip install jsonschema)") from None

    from specjet.models.weights import resolve_model_path

    try:
        entries = jsonschema_prompts(args.num_schemas, args.schema_dir)
        if args.schema_indices is not None:
            bad = [i for i in args.schema_indices if not 0 <= i < len(entries)]
            if bad:
                raise ValueError(f"--schema-indices {bad} out of range: {len(entries)} entries")
            entries = [entries[i] for i in args.schema_indices]
    except ValueError as exc:
        raise SystemExit(f"bench.json: {exc}") from None
    validators = [load_validator(e["schema"]) for e in entries]
    configs = configurations(args)
    reference = reference_config(configs).name
    model_dir = resolve_model_path(args.model_path)
    print(f"{len(configs)} configurations of {model_dir}, {len(entries)} schemas", file=sys.stderr)
    cells, described, baseline = run_all(configs, engine_kwargs(args), entries, args)

    identity = identity_check(cells, reference)
    rows = result_rows(cells, entries, validators, identity)
    lengths = [o["meta_info"]["prompt_tokens"] for o in cells[0].outputs]
    header = {"benchmark": "json", "record_version": 1, "command": command, "date": date,
              "machine": dict(machine, load_avg_after=machine_info()["load_avg"]), "model_dir": str(model_dir),
              "schema_dir": args.schema_dir, "schemas": [e["name"] for e in entries], "configs": described,
              "baseline": baseline.name if baseline else None,
              "prompt_tokens": {"count": len(lengths), "min": min(lengths), "max": max(lengths)},
              "max_new_tokens": args.max_new_tokens, "batch_sizes": args.batch_sizes, "repeats": args.repeats}
    print(format_report(header, rows, identity), flush=True)
    record = dict(header, args=vars(args), results=rows,
                  outputs_identical=identity_record(identity))
    if args.result_file:
        append_jsonl(args.result_file, record)
        print(f"# appended to {args.result_file}", flush=True)
    if not identity["identical"]:
        print(identity_line(identity, constrained_names(rows)), file=sys.stderr)
        raise SystemExit("bench.json: greedy outputs differ between configurations (see above)")
    return record


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
