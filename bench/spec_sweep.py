"""A grid of speculative-decoding configurations against plain decoding, so that the defaults are
chosen from data: ``python -m bench.latency --sweep --speculative-algorithm EAGLE|NGRAM`` (or
``python -m bench.spec_sweep --speculative-algorithm ...``, the same flags).

Grid (each axis overridable with ``--sweep-*``): EAGLE num_steps {1, 3, 5} x topk {1, 4} x
num_draft_tokens {4, 8, 12, 16} x hybrid n-gram nodes {0}, skipping trees the drafter cannot fill (num_draft_tokens >
1 + topk + (num_steps - 1) * topk^2: the root plus every candidate it expands); NGRAM
num_draft_tokens {4, 8, 12} x max_bfs_breadth {1, 4}. The other engine flags (``--dtype``,
``--speculative-draft-model-path``, ...) apply to every configuration, and the plain engine (the
same flags without speculation) is one more configuration, the baseline of the speed-ups.

One engine per configuration, loaded on its own: the sweep runs ``--repeats`` rounds, and in each
round loads every configuration in turn (the order reversed every other round, so slow drift in the
machine's load hits all configurations alike), warms it up at each workload and batch size, times
one run (t_1 and t_N passes, as bench.latency) at each, and shuts it down. Per workload and batch
size (default batch size 1) a table sorted by median decode tok/s gives the accept length (accepted
tokens / verify forwards over the N-token passes), the tok/s median, min and max and the speed-up
over plain; a ranking by the geometric mean of the speed-ups over the workloads closes each batch
size. Every configuration's greedy outputs must equal plain's ("outputs identical: yes").
"""
from __future__ import annotations

import argparse
import gc
import itertools
import math
import sys

from bench.common import engine_kwargs, fmt_num, identity_record, without_speculation
from bench.decode_rate import Measurement, SpecjetSystem, make_batches, timed_run, warm_up
from bench.latency_common import (Workload, finish, header_lines, identity_check, identity_line, make_header,
                                  parse_args, prepare, workload_heading)

PLAIN = "plain"


def eagle_max_nodes(num_steps: int, topk: int) -> int:
    """Most tree nodes an EAGLE draft can hold: the root, its topk children, and topk^2 per later step."""
    return 1 + topk + (num_steps - 1) * topk * topk


def grid(algorithm: str, axes: dict) -> tuple[list[dict], list[dict]]:
    """The configurations (Engine keywords) of the grid, and the impossible ones skipped."""
    configs, skipped = [], []
    if algorithm == "EAGLE":
        for steps, topk, nodes, hybrid in itertools.product(axes["num_steps"], axes["topk"], axes["num_draft_tokens"],
                                                            axes["hybrid_ngram_tokens"]):
            kw = {"speculative_num_steps": steps, "speculative_eagle_topk": topk,
                  "speculative_num_draft_tokens": nodes, "speculative_hybrid_ngram_tokens": hybrid}
            (skipped if nodes > eagle_max_nodes(steps, topk) else configs).append(kw)
    else:
        for nodes, breadth in itertools.product(axes["num_draft_tokens"], axes["ngram_breadth"]):
            configs.append({"speculative_num_draft_tokens": nodes, "speculative_ngram_max_bfs_breadth": breadth})
    return configs, skipped


def label(kw: dict) -> str:
    short = {"speculative_num_steps": "steps", "speculative_eagle_topk": "topk",
             "speculative_num_draft_tokens": "draft", "speculative_ngram_max_bfs_breadth": "breadth",
             "speculative_hybrid_ngram_tokens": "ngram"}
    # No n-gram nodes is EAGLE as it always was: not named.
    return " ".join(f"{name}={kw[key]}" for key, name in short.items()
                    if key in kw and (kw[key] or key != "speculative_hybrid_ngram_tokens"))


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values and all(v > 0 for v in values) else None


def sweep_figures(measurements: list[Measurement], names: list[str]) -> dict:
    by = {(m.system, m.workload, m.batch_size): m for m in measurements}
    median = {k: m.summary()["median"] for k, m in by.items()}
    workloads = list(dict.fromkeys(m.workload for m in measurements))
    sizes = sorted({m.batch_size for m in measurements})
    out = {}
    for bs in sizes:
        per_config = {}
        for name in names:
            speedups = {w: (median[(name, w, bs)] / median[(PLAIN, w, bs)]
                            if median[(name, w, bs)] is not None and median[(PLAIN, w, bs)] else None)
                        for w in workloads}
            per_config[name] = {
                "decode_tok_s": {w: median[(name, w, bs)] for w in workloads},
                "accept_length": {w: by[(name, w, bs)].accept_length for w in workloads},
                "speedup": speedups,
                "geomean_speedup": _geomean([s for s in speedups.values() if s is not None])
                if all(s is not None for s in speedups.values()) else None,
            }
        ranking = sorted((n for n in names if n != PLAIN),
                         key=lambda n: -(per_config[n]["geomean_speedup"] or 0.0))
        out[str(bs)] = {"configs": per_config, "ranking": ranking}
    return out


def format_sweep(header: dict, measurements: list[Measurement], figs: dict, identity: dict) -> str:
    sweep = header["sweep"]
    lines = header_lines(header)
    axes = " x ".join(f"{k} {{{', '.join(map(str, v))}}}" for k, v in sweep["grid"].items())
    lines += [
        f"# sweep: {sweep['algorithm']}, {len(sweep['configs'])} configurations of {axes}"
        + (f" ({len(sweep['skipped'])} impossible skipped)" if sweep["skipped"] else "")
        + f", against {PLAIN} (the same engine without speculation); fixed: {sweep['fixed'] or 'engine defaults'}",
        f"# one engine per configuration, loaded afresh in each of {header['repeats']} rounds (order reversed every "
        f"other round); N={header['max_new_tokens']} new tokens per request, greedy, EOS ignored",
        "# decode tok/s = decode tokens / (t_N - t_1) as bench.latency, median over the rounds; accept = accepted "
        "tokens / verify forwards over the N-token passes; speed-up = median tok/s / plain's",
    ]
    for bs, f in figs.items():
        for workload, info in header["workloads"].items():
            rows = [m for m in measurements if m.workload == workload and m.batch_size == int(bs)]
            rows.sort(key=lambda m: -(m.summary()["median"] or 0.0))
            lines += ["", workload_heading(workload, info) + f", batch size {bs}",
                      f"{'config':<28} {'accept':>7} {'decode tok/s':>12} {'min':>8} {'max':>8} {'speed-up':>9}"]
            for m in rows:
                s = m.summary()
                speedup = f["configs"][m.system]["speedup"][workload]
                accept = "-" if m.accept_length is None else f"{m.accept_length:.2f}"
                lines.append(f"{m.system:<28} {accept:>7} {fmt_num(s['median']):>12} {fmt_num(s['min']):>8} "
                             f"{fmt_num(s['max']):>8} {fmt_num(speedup, '.2f') + 'x':>9}")
        workloads = list(header["workloads"])
        lines += ["", f"## ranking at batch size {bs}: geometric mean of the speed-ups over {', '.join(workloads)}",
                  f"{'config':<28} {'geomean':>8} " + " ".join(f"{w + ' x':>10} {w + ' acc':>10}" for w in workloads)]
        for name in f["ranking"]:
            c = f["configs"][name]
            cells = [f"{fmt_num(c['speedup'][w], '.2f') + 'x':>10} {fmt_num(c['accept_length'][w], '.2f'):>10}"
                     for w in workloads]
            lines.append(f"{name:<28} {fmt_num(c['geomean_speedup'], '.2f') + 'x':>8} " + " ".join(cells))
    lines += ["", identity_line(identity, f"every configuration vs {PLAIN}, greedy")]
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace, workloads: list[Workload], context: dict) -> dict:
    from tqdm.auto import tqdm

    base = engine_kwargs(args)
    configs, skipped = grid(args.speculative_algorithm, args.sweep_grid)
    if not configs:
        raise SystemExit("bench.latency --sweep: every configuration of the grid is impossible")
    systems = [(PLAIN, without_speculation(base))] + [(label(c), dict(base, **c)) for c in configs]
    names = [name for name, _ in systems]
    n = args.max_new_tokens
    batches = {(w.name, bs): make_batches(w.prompts, bs) for w in workloads for bs in args.batch_sizes}
    table = {(name, w.name, bs): Measurement(name, w.name, bs, sum(map(len, batches[(w.name, bs)])))
             for name in names for w in workloads for bs in args.batch_sizes}
    effective: dict[str, dict | None] = {}
    print(f"sweep: {len(configs)} {args.speculative_algorithm} configurations + {PLAIN}, {args.repeats} rounds",
          file=sys.stderr)
    with tqdm(total=args.repeats * len(systems), unit="engine", desc="bench.latency --sweep", file=sys.stderr,
              dynamic_ncols=True) as bar:
        for rnd in range(args.repeats):
            for name, kwargs in (systems if rnd % 2 == 0 else systems[::-1]):
                bar.set_description(f"round {rnd + 1}/{args.repeats} {name}")
                system = SpecjetSystem(name, kwargs)
                try:
                    effective.setdefault(name, system.describe())
                    for w in workloads:
                        for bs in args.batch_sizes:
                            warm_up(system, batches[(w.name, bs)], n)
                    for w in workloads:
                        for bs in args.batch_sizes:
                            timed_run(system, batches[(w.name, bs)], n, table[(name, w.name, bs)])
                finally:
                    system.close()
                    del system
                    gc.collect()
                bar.update()

    measurements = list(table.values())
    header = make_header("latency-sweep", context, workloads, args)
    fixed = {k: v for k, v in base.items() if k.startswith("speculative_") and k != "speculative_algorithm"}
    header["sweep"] = {
        "algorithm": args.speculative_algorithm,
        "grid": args.sweep_grid,
        "configs": [{"label": label(c), "engine_kwargs": c, "effective": effective.get(label(c))} for c in configs],
        "skipped": skipped,
        "fixed": fixed,
    }
    identity = identity_check(measurements, PLAIN)
    figs = sweep_figures(measurements, names)
    record = dict(header, args=vars(args), figures=figs, outputs_identical=identity_record(identity),
                  results=[m.record() for m in measurements])
    return finish(record, format_sweep(header, measurements, figs, identity), args)


def main(argv: list[str] | None = None) -> dict:
    """``python -m bench.latency --sweep ...``."""
    args = parse_args(["--sweep", *(sys.argv[1:] if argv is None else argv)], "python -m bench.spec_sweep",
                      __doc__.split("\n\n")[0])
    setup = prepare(args)
    return run_sweep(args, setup.workloads, setup.context)


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
