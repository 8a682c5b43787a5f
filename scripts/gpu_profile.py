"""Where a decode iteration's host time goes on a GPU (run by ``scripts/gpu_check.sh profile`` on a lent
machine, after the bench phase has unpacked the default model): torch.profiler on the scheduler thread,
where the engine's loop runs with the overlap loop off (``Scheduler.run_in_loop`` starts and stops it
there: the profiler records the ops of the thread that started it), over one greedy request per algorithm.

Prints per algorithm the top ops by their own host time and, per iteration (verify forwards, or output
tokens for plain decoding), the CUDA runtime calls that cost a GPU iteration its host time: kernel and
graph launches, copies, synchronisations. A GPU iteration of this model is host-bound (bench/RESULTS.md,
sessions 38 and 53), so these counts are what to cut. Runs on a CPU too (host ops only), as the tests do.

    python scripts/gpu_profile.py [--device cuda] [--algorithms none EAGLE DFLASH] [--json] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

RUNTIME_CALLS = ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize",
                 "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaEventRecord", "cudaStreamWaitEvent")
SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, '
          '"hobbies": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "hobbies"]}')


def profile_one(algorithm: str, args) -> dict:
    import specjet

    # The overlap loop off: the iteration's host and compute work in the one thread profiled (the
    # speculative iteration is synchronous either way).
    kwargs = {"device": args.device, "dtype": args.dtype, "disable_overlap_schedule": True,
              "model_path": args.model_path}
    if args.device == "cpu" and args.model_path is None:
        kwargs["quantization"] = None  # the embedded GGUF's float weights, as on the GPU
    if algorithm != "none":  # every iteration drafts (no pauses by the payoff controller)
        kwargs.update(speculative_algorithm=algorithm, speculative_measured_payoff=False)
    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": not args.json}
    if args.json:
        params["json_schema"] = SCHEMA
    prompt = "Describe a person as a JSON object." if args.json else "Write a short story about a lighthouse keeper."
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with specjet.Engine(**kwargs) as eng:
        eng.generate([prompt], params)  # warm-up: graphs captured, kernels compiled
        prof = profile(activities=activities)
        eng.scheduler.run_in_loop(prof.__enter__).result()
        try:
            out = eng.generate([prompt], params)[0]
        finally:
            eng.scheduler.run_in_loop(lambda: prof.__exit__(None, None, None)).result()
        eng.check_kv_invariant()
    meta = out["meta_info"]
    iterations = meta.get("spec_verify_ct") or len(out["output_ids"])
    events = prof.key_averages()
    calls = collections.Counter({e.key: e.count for e in events})
    per_iteration = {name: round(calls[name] / iterations, 1) for name in RUNTIME_CALLS if calls[name]}
    ops = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)[:args.top]
    print(f"## {algorithm} ({'json' if args.json else 'text'}): {len(out['output_ids'])} tokens, "
          f"{iterations} iterations; per iteration: {per_iteration}")
    print(f"{'op':<32} {'calls/it':>8} {'host us/it':>10}")
    for e in ops:
        print(f"{e.key:<32} {e.count / iterations:>8.1f} {e.self_cpu_time_total / iterations:>10.1f}")
    return {"algorithm": algorithm, "iterations": iterations, "runtime_calls_per_iteration": per_iteration,
            "aten_calls_per_iteration": round(sum(e.count for e in events if e.key.startswith("aten::")) / iterations, 1)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model-path", default=None, help="default: the embedded model")
    parser.add_argument("--algorithms", nargs="+", default=["none", "EAGLE", "DFLASH"])
    parser.add_argument("--json", action="store_true", help="decode under a JSON schema (grammar-aware drafting)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    return [profile_one(a, args) for a in args.algorithms]


if __name__ == "__main__":
    main()
