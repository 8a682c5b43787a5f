"""Where the engine's loop spends its time: cProfile of the scheduler thread over a greedy workload.

    python -m bench.profile_loop [--workload gsm8k|json] [--num-prompts 4] [--max-new-tokens 128]
                                 [--batch-size 1] [--top 40] [engine flags, e.g. --speculative-algorithm EAGLE]

Runs the overlap loop off (the host's and the compute side's work in one thread, the one profiled),
after one warm-up pass, and prints the functions with the most time of their own and the most time
below them (pstats' tables over the timed pass, with the pass's iterations to divide by), so a step's
cost outside the model forward can be found by name. ``--sort`` picks the first table's order.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import threading
import time

from bench import common
from specjet.arg_types import positive_int


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_loop", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("gsm8k", "json"), default="gsm8k")
    parser.add_argument("--num-prompts", type=positive_int, default=4)
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=1, help="requests in flight at once")
    parser.add_argument("--top", type=positive_int, default=40)
    parser.add_argument("--sort", choices=("tottime", "cumulative"), default="tottime")
    parser.add_argument("--data-path", default=str(common.GSM8K_TEST))
    parser.add_argument("--json-path", default=str(common.JSONSCHEMA_DIR))
    common.add_engine_args(parser)
    return parser.parse_args(argv)


def workload(args, engine) -> tuple[list[str], list[dict]]:
    greedy = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    tok = engine.tokenizer
    if args.workload == "gsm8k":
        texts = [q["question"] for q in common.gsm8k_questions(args.num_prompts, args.data_path)]
        return [common.chat_prompt(tok, t) for t in texts], [greedy] * len(texts)
    entries = common.jsonschema_prompts(args.num_prompts, args.json_path)
    return ([common.chat_prompt(tok, e["prompt"]) for e in entries],
            [dict(greedy, json_schema=e["schema"]) for e in entries])


def main(argv=None) -> str:
    args = parse_args(argv)
    import specjet
    from specjet.scheduler import event_loops

    kwargs = dict(common.engine_kwargs(args), disable_overlap_schedule=True)
    profiler = cProfile.Profile()
    profiling = threading.Event()
    real_step = event_loops.EventLoop._normal_iteration

    def step(self, *a, **kw):  # the loop's one iteration, profiled while a timed pass runs
        if not profiling.is_set():
            return real_step(self, *a, **kw)
        profiler.enable()
        try:
            return real_step(self, *a, **kw)
        finally:
            profiler.disable()

    event_loops.EventLoop._normal_iteration = step
    with specjet.Engine(**kwargs) as engine:
        prompts, params = workload(args, engine)
        common.generate_all(engine, prompts, params, args.batch_size)  # warm-up (compiles, captures)
        engine.get_server_info(reset_timings=True)
        profiling.set()
        start = time.perf_counter()
        outs = common.generate_all(engine, prompts, params, args.batch_size)
        wall = time.perf_counter() - start
        profiling.clear()
    tokens = sum(len(o["output_ids"]) for o in outs)
    stats = pstats.Stats(profiler, stream=(buf := io.StringIO()))
    stats.sort_stats(args.sort).print_stats(args.top)
    stats.sort_stats("cumulative" if args.sort == "tottime" else "tottime").print_stats(args.top)
    report = (f"# {common.command_line()}\n# {common.machine_line(common.machine_info())}\n"
              f"# {len(prompts)} requests, {tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tok/s, "
              f"profiler on)\n" + buf.getvalue())
    print(report)
    return report


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
