"""How long the compute side waits for the host, with and without the overlap loop.

    python -m bench.overlap [--batch-sizes 1 4 16] [--max-new-tokens 64] [--unconstrained] [engine flags]

For each loop (overlap on, then off) and batch size, runs that many JSON-schema-constrained requests
at once (dev-set prompts, chat-formatted, greedy) and reports, per decode iteration, the compute
side's median time, its median wait for the host (the gap between the end of one work item and the
start of the next, timestamped on the compute side) and that wait as a fraction of the iteration,
plus the median TPOT of the requests. Appends a JSONL record to ``--result-file``.
"""
from __future__ import annotations

import argparse
import time

from bench import common
from bench.engine_info import describe_engine, speculation_str
from bench.json import latency_figures
from specjet.arg_types import positive_int


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--repeats", type=positive_int, default=2, help="timed passes per cell (figures pool them)")
    parser.add_argument("--unconstrained", action="store_true", help="no json_schema (plain text requests)")
    parser.add_argument("--schema-dir", default=str(common.JSONSCHEMA_DIR))
    parser.add_argument("--result-file", default="bench/out/overlap.jsonl")
    common.add_engine_args(parser)
    args = parser.parse_args(argv)
    if args.disable_overlap_schedule is not None:
        parser.error("the loops are this bench's axis: it runs both, without --(no-)disable-overlap-schedule")
    return args


def run_cell(engine, prompts: list[str], params: list[dict], batch_size: int, repeats: int) -> dict:
    batch = [prompts[i % len(prompts)] for i in range(batch_size)]
    sps = [params[i % len(params)] for i in range(batch_size)]
    engine.generate(batch, sps)  # warm-up
    engine.get_server_info(reset_timings=True)
    outs, wall = [], 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        outs += engine.generate(batch, sps)
        wall += time.perf_counter() - start
    figures = latency_figures(outs, wall)  # TPOT median over every request of every pass
    overlap = engine.get_server_info(reset_timings=True)["stats"]["overlap"]
    return {"batch_size": batch_size, "tpot_ms": figures["tpot_ms"], "output_tok_s": figures["output_tok_s"],
            **overlap}


def main(argv=None) -> dict:
    args = parse_args(argv)
    import specjet

    kwargs = common.engine_kwargs(args)
    command, date, machine = common.command_line(), common.now(), common.machine_info()
    print("\n".join(common.report_header_lines(command, date, machine)), flush=True)
    entries = common.jsonschema_prompts(folder=args.schema_dir)
    rows = []
    for overlap in (True, False):
        with specjet.Engine(**kwargs, disable_overlap_schedule=not overlap) as engine:
            desc = describe_engine(engine)
            print(f"# {'overlap' if overlap else 'plain'} loop: {desc['dtype']} on {desc['device']}, "
                  f"speculative {speculation_str(desc)}", flush=True)
            prompts = [common.chat_prompt(engine.tokenizer, e["prompt"]) for e in entries]
            params = [{"temperature": 0, "max_new_tokens": args.max_new_tokens,
                       **({} if args.unconstrained else {"json_schema": e["schema"]})} for e in entries]
            for bs in args.batch_sizes:
                row = dict(run_cell(engine, prompts, params, bs, args.repeats), overlap=overlap)
                rows.append(row)
                print(f"overlap={'on ' if overlap else 'off'} bs={bs:<3} compute {row.get('compute_ms_median', 0):6.1f} ms"
                      f"  wait {row.get('wait_ms_median', 0):6.2f} ms ({100 * row.get('wait_fraction_median', 0):4.1f} %)"
                      f"  TPOT {row['tpot_ms'] or 0:6.1f} ms  {row['output_tok_s']:6.1f} tok/s", flush=True)
            engine.check_kv_invariant()  # a loop that leaks KV must not pass for a fast one
    print("\n| batch | loop | compute ms/iter | wait ms/iter | wait % (median) | wait % (total) | TPOT ms | tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["batch_size"], not r["overlap"])):
        print(f"| {r['batch_size']} | {'overlap' if r['overlap'] else 'plain'} | {r.get('compute_ms_median', 0):.1f} | "
              f"{r.get('wait_ms_median', 0):.2f} | {100 * r.get('wait_fraction_median', 0):.1f} | "
              f"{100 * r.get('wait_fraction_mean', 0):.1f} | {r['tpot_ms'] or 0:.1f} | {r['output_tok_s']:.1f} |")
    for bs in args.batch_sizes:
        on = next(r for r in rows if r["batch_size"] == bs and r["overlap"])
        off = next(r for r in rows if r["batch_size"] == bs and not r["overlap"])
        if on["tpot_ms"] and off["tpot_ms"]:
            print(f"bs={bs}: TPOT overlap/plain = {on['tpot_ms'] / off['tpot_ms']:.3f}")
    machine["load_avg_after"] = common.machine_info()["load_avg"]
    record = {"benchmark": "overlap", "command": command, "date": date, "machine": machine, "args": vars(args),
              "rows": rows}
    common.append_jsonl(args.result_file, record)
    return record


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
