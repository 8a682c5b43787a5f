"""Short requests after a pause: what an agent app's sporadic calls see.

    python -m bench.pause [--loops plain overlap] [--pauses 0 100 300] [--requests 10] [--max-new-tokens 1]
                          [--json-constrained] [engine flags]

For each loop (one engine at a time, loaded, warmed up, then shut down) and each pause, sends
``--requests`` requests one at a time (JSON dev-set prompts, chat-formatted, greedy), each after the
engine has idled for the pause (0: back to back), and reports per cell the median request time with its
quartiles and the median CPU time the process spent on it (every thread's, from ``getrusage``): CPU time
about equal to wall time on a 2-thread forward means one core did the work, which is what an OpenMP team
whose worker woke on its master's CPU looks like (bench/RESULTS.md, session 54). Ends each engine with
the KV invariant; appends a JSONL record to ``--result-file``.
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time

from bench import common
from bench.engine_info import describe_engine, speculation_str
from specjet.arg_types import non_negative_float

LOOPS = {"plain": True, "overlap": False}  # --loops value -> disable_overlap_schedule


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.pause", description=__doc__.split("\n\n")[0])
    parser.add_argument("--loops", nargs="+", choices=list(LOOPS), default=list(LOOPS))
    parser.add_argument("--pauses", type=non_negative_float, nargs="+", default=[0.0, 100.0, 300.0],
                        help="ms the engine idles before each request (0: back to back)")
    parser.add_argument("--requests", type=int, default=10, help="requests per (loop, pause) cell")
    parser.add_argument("--max-new-tokens", type=int, default=1)
    parser.add_argument("--json-constrained", action="store_true", help="decode under each prompt's schema")
    parser.add_argument("--schema-dir", default=str(common.JSONSCHEMA_DIR))
    parser.add_argument("--result-file", default="bench/out/pause.jsonl")
    common.add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.requests < 2 or args.max_new_tokens < 1:
        parser.error("--requests must be >= 2 and --max-new-tokens >= 1")
    if args.disable_overlap_schedule is not None:
        parser.error("the loops are this bench's axis: choose them with --loops, not --(no-)disable-overlap-schedule")
    return args


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_cell(engine, requests: list[tuple[str, dict]], pause_s: float) -> dict:
    """One request after each pause: wall and process CPU ms per request, summarised."""
    walls, cpus = [], []
    for prompt, params in requests:
        time.sleep(pause_s)
        cpu, start = _cpu_seconds(), time.perf_counter()
        engine.generate(prompt, params)
        walls.append(1e3 * (time.perf_counter() - start))
        cpus.append(1e3 * (_cpu_seconds() - cpu))
    q1, _, q3 = statistics.quantiles(walls, n=4)
    return {"pause_ms": 1e3 * pause_s, "requests": len(walls), "wall_ms_median": statistics.median(walls),
            "wall_ms_p25": q1, "wall_ms_p75": q3, "cpu_ms_median": statistics.median(cpus),
            "wall_ms": walls, "cpu_ms": cpus}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import specjet

    kwargs = common.engine_kwargs(args)
    command, date, machine = common.command_line(), common.now(), common.machine_info()
    print("\n".join(common.report_header_lines(command, date, machine)), flush=True)
    entries = common.jsonschema_prompts(folder=args.schema_dir)
    rows, engines = [], {}
    for loop in args.loops:
        with specjet.Engine(**kwargs, disable_overlap_schedule=LOOPS[loop]) as engine:
            desc = engines[loop] = describe_engine(engine)
            print(f"# {loop} loop: {desc['dtype']} on {desc['device']}, speculative {speculation_str(desc)}",
                  flush=True)
            requests = [(common.chat_prompt(engine.tokenizer, e["prompt"]),
                         {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True,
                          **({"json_schema": e["schema"]} if args.json_constrained else {})})
                        for e in entries[:args.requests]]
            requests = [requests[i % len(requests)] for i in range(args.requests)]
            for prompt, params in requests:  # warm-up: grammars compiled, prompts cached, team built
                engine.generate(prompt, params)
            for pause in args.pauses:
                row = dict(run_cell(engine, requests, pause / 1e3), loop=loop)
                rows.append(row)
                print(f"{loop:<8} pause {row['pause_ms']:6.0f} ms: request {row['wall_ms_median']:7.2f} ms "
                      f"(p25 {row['wall_ms_p25']:.2f}, p75 {row['wall_ms_p75']:.2f}), CPU {row['cpu_ms_median']:7.2f} ms",
                      flush=True)
            engine.check_kv_invariant()  # a loop that leaks KV must not pass for a fast one
    print("\n| loop | pause ms | request ms (median) | p25 | p75 | CPU ms (median) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['loop']} | {r['pause_ms']:.0f} | {r['wall_ms_median']:.2f} | {r['wall_ms_p25']:.2f} | "
              f"{r['wall_ms_p75']:.2f} | {r['cpu_ms_median']:.2f} |")
    record = {"command": command, "date": date, "machine": machine, "args": vars(args), "engines": engines,
              "rows": rows}
    common.append_jsonl(args.result_file, record)
    return record


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
