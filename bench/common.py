"""What the benchmarks share: engine-argument flags, GSM8K and JSON-schema prompts, sending requests
concurrently, a description of the machine, the greedy-identity check and the tables' number format."""
from __future__ import annotations

# Every model directory is local; transformers must not try a hub.
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import datetime
import json
import pathlib
import platform
import shlex
import subprocess
import sys
from typing import Any, Callable

from specjet.arg_types import existing_path

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
GSM8K_TEST = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
JSONSCHEMA_DIR = REPO_ROOT.parent / "shared" / "data" / "jsonschema"  # index.json + one file per schema

# flag dest -> Engine keyword (SGLang's names, see specjet/engine/args.py)
_ENGINE_FLAGS = {
    "model_path": "model_path",
    "dtype": "dtype",
    "device": "device",
    "quantization": "quantization",
    "page_size": "page_size",
    "max_running_requests": "max_running_requests",
    "max_total_tokens": "max_total_tokens",
    "kv_cache_dtype": "kv_cache_dtype",
    "disable_overlap_schedule": "disable_overlap_schedule",
    "disable_radix_cache": "disable_radix_cache",
    "chunked_prefill_size": "chunked_prefill_size",
    "random_seed": "random_seed",
    "speculative_algorithm": "speculative_algorithm",
    "speculative_num_steps": "speculative_num_steps",
    "speculative_eagle_topk": "speculative_eagle_topk",
    "speculative_num_draft_tokens": "speculative_num_draft_tokens",
    "speculative_dflash_draft_window_size": "speculative_dflash_draft_window_size",
    "speculative_draft_min_prob": "speculative_draft_min_prob",
    "speculative_draft_model_path": "speculative_draft_model_path",
    "speculative_draft_model_quantization": "speculative_draft_model_quantization",
    "speculative_ngram_max_bfs_breadth": "speculative_ngram_max_bfs_breadth",
    "speculative_grammar_aware": "speculative_grammar_aware",
    "speculative_measured_payoff": "speculative_measured_payoff",
    "speculative_hybrid_ngram_tokens": "speculative_hybrid_ngram_tokens",
    "speculative_max_verify_tokens": "speculative_max_verify_tokens",
    "speculative_draft_runner": "speculative_draft_runner",
    "disable_cuda_graph": "disable_cuda_graph",
    "disable_guided_drafting": "disable_guided_drafting",
    "disable_free_text_drafting": "disable_free_text_drafting",
    "enable_deterministic_inference": "enable_deterministic_inference",
    "disable_canonical_forced_text": "disable_canonical_forced_text",
}
SPECULATIVE_KWARGS = tuple(kw for kw in _ENGINE_FLAGS.values() if kw.startswith("speculative_"))


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Engine's flags. Each defaults to None (the Engine's own default); a benchmark that needs
    another default sets it with ``parser.set_defaults(...)``."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model-path", default=None, type=existing_path,
                       help="model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    group.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                       help="default auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX), "
                            "else float32")
    group.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:1, ...")
    group.add_argument("--quantization", default=None, choices=["auto", "none", "int8", "int4", "gguf"],
                       help="weight-only quantization (CPU kernels; dtype auto then means float32); default: the "
                            "engine's auto (the GGUF's own blocks for a GGUF model on CPU), none: float weights")
    group.add_argument("--page-size", type=int, default=None)
    group.add_argument("--max-running-requests", type=int, default=None)
    group.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    group.add_argument("--kv-cache-dtype", default=None, choices=["auto", "bfloat16", "float32"],
                       help="default auto: bfloat16 beside quantized weights on CPU, else the model's dtype")
    group.add_argument("--disable-overlap-schedule", action=argparse.BooleanOptionalAction, default=None,
                       help="the plain loop (--no-...: the overlap loop; default: plain on the CPU, overlap on CUDA)")
    group.add_argument("--disable-radix-cache", action="store_true", default=None,
                       help="no prefix cache: every prompt is prefilled whole")
    group.add_argument("--chunked-prefill-size", type=int, default=None,
                       help="prompts longer than this prefill in chunks (default 2048; -1: off)")
    group.add_argument("--random-seed", type=int, default=None)
    group.add_argument("--disable-canonical-forced-text", action="store_true", default=None,
                       help="a grammar's forced text in any tokens the model picks (default: the tokenizer's split)")
    group.add_argument("--enable-deterministic-inference", default=None, type=_parse_bool, metavar="{true,false}",
                       help="batch-invariant attention on CPU (default true; false: SDPA, faster at large batches)")
    spec = parser.add_argument_group("speculative decoding (engine defaults where unset)")
    spec.add_argument("--speculative-algorithm", default=None, choices=["EAGLE", "NGRAM", "DFLASH"])
    spec.add_argument("--speculative-num-steps", type=int, default=None, help="EAGLE draft depth (default 4)")
    spec.add_argument("--speculative-eagle-topk", type=int, default=None,
                      help="EAGLE branching per draft step (default 4)")
    spec.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                      help="tree nodes per verify, root included (default: EAGLE 12, NGRAM 8; DFLASH: its block, 8)")
    spec.add_argument("--speculative-draft-model-path", default=None,
                      help="EAGLE head / DFlash draft directory (default: the one shipped in specjet/assets)")
    spec.add_argument("--speculative-draft-model-quantization", default=None,
                      choices=["auto", "none", "int8", "int4", "gguf"],
                      help="EAGLE head's / DFlash draft's weights (default auto: the target's method for a "
                           "quantized target, int8 beside a float one on CPU; none: float)")
    spec.add_argument("--speculative-dflash-draft-window-size", type=int, default=None,
                      help="DFLASH: context positions the draft sees before its block (default: all)")
    spec.add_argument("--speculative-draft-min-prob", type=float, default=None,
                      help="EAGLE, DFLASH: tree nodes whose path probability under the draft is below this are "
                           "not verified (default 0.1; 0: the whole tree)")
    spec.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=None,
                      help="NGRAM distinct continuations per draft (default 4)")
    spec.add_argument("--speculative-grammar-aware", default=None, type=_parse_bool, metavar="{true,false}",
                      help="grammar-aware drafting for constrained requests (default true)")
    spec.add_argument("--speculative-measured-payoff", default=None, type=_parse_bool, metavar="{true,false}",
                      help="EAGLE, DFLASH: free text decoding alone drafts only while drafting measures "
                           "faster than plain steps (default: on a CPU target)")
    spec.add_argument("--speculative-hybrid-ngram-tokens", type=int, default=None,
                      help="EAGLE trees also take the best n-gram continuation, up to this many nodes "
                           "(default 14, half of it as a rule, more while the request's paths are taken whole; "
                           "0: the head's trees alone)")
    spec.add_argument("--speculative-max-verify-tokens", type=int, default=None,
                      help="tree nodes one verify may hold across the batch; each tree gets an even share "
                           "(default: no cap)")
    spec.add_argument("--speculative-draft-runner", default=None, choices=["auto", "eager", "static"],
                      help="the drafters' fixed-shape forwards: static = padded batch buckets on static buffers, "
                           "CUDA graphs on CUDA (default auto: graphs on CUDA, eager on CPU)")
    spec.add_argument("--disable-cuda-graph", action="store_true", default=None, help="never capture CUDA graphs")
    return parser


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Engine keywords for the flags that were set (None means: leave it to the Engine; its dtype
    ``auto`` follows the CPU: bf16 with native bf16 instructions, else fp32)."""
    kwargs = {kw: getattr(args, dest) for dest, kw in _ENGINE_FLAGS.items() if getattr(args, dest, None) is not None}
    for name in ("quantization", "speculative_draft_model_quantization"):
        if kwargs.get(name) == "none":  # the engine's None: float weights
            kwargs[name] = None
    return kwargs


def without_speculation(kwargs: dict) -> dict:
    """The same Engine keywords with every ``speculative_*`` one dropped and guided drafting off: the plain engine,
    which drafts for no request."""
    return dict(default_speculation(kwargs), disable_guided_drafting=True)


def default_speculation(kwargs: dict) -> dict:
    """The same Engine keywords with every ``speculative_*`` one dropped: the engine without
    ``speculative_algorithm``, whose requests with a prediction or a grammar still draft (guided drafting)."""
    return {k: v for k, v in kwargs.items() if k not in SPECULATIVE_KWARGS}


def gsm8k_questions(n: int | None = None, data_path: str | os.PathLike = GSM8K_TEST) -> list[dict]:
    """The first ``n`` GSM8K items (all when None), each a dict with ``question`` and ``answer``
    (the reference solution, ending in ``#### <number>``), in file order."""
    items = []
    with open(data_path, encoding="utf-8") as f:
        for line in f:
            if n is not None and len(items) >= n:
                break
            if line.strip():
                record = json.loads(line)
                items.append({"question": record["question"], "answer": record["answer"]})
    if n is not None and len(items) < n:
        raise ValueError(f"{data_path} has only {len(items)} items, {n} asked for")
    return items


def jsonschema_prompts(n: int | None = None, folder: str | os.PathLike = JSONSCHEMA_DIR) -> list[dict]:
    """The first ``n`` entries of ``folder/index.json`` (all when None), in index order, each a dict
    with ``name``, ``file``, ``prompt`` (a request for a JSON object, naming its fields) and ``schema``
    (the schema file's text)."""
    folder = pathlib.Path(folder)
    entries = json.loads((folder / "index.json").read_text(encoding="utf-8"))["schemas"]
    if n is not None:
        if len(entries) < n:
            raise ValueError(f"{folder / 'index.json'} has only {len(entries)} schemas, {n} asked for")
        entries = entries[:n]
    return [{"name": e.get("name", e["file"]), "file": e["file"], "prompt": e["prompt"],
             "schema": (folder / e["file"]).read_text(encoding="utf-8")} for e in entries]


def run_cli(main: Callable[[], Any]) -> Any:
    """A bench's entry point: ``main()``, where a path that is not there (a model, a data file or folder) is a
    one-line error and exit status 2, not a traceback."""
    try:
        return main()
    except (FileNotFoundError, NotADirectoryError) as error:
        module = sys.modules["__main__"].__spec__
        print(f"python -m {module.name if module else 'bench'}: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def chat_prompt(tokenizer, text: str, history: list[dict] | None = None) -> str:
    """``text`` as one user turn in the model's chat template, ready for the assistant's reply
    (what ``Engine.apply_chat_template(text)`` gives), after the turns of ``history`` if any."""
    return tokenizer.apply_chat_template([*(history or []), {"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def chat_history(tokenizer, tokens: int, data_path: str | os.PathLike = GSM8K_TEST) -> list[dict]:
    """Earlier turns for a long-context workload (an agent's conversation so far): GSM8K questions and
    their reference solutions as user / assistant turns, taken from the end of the file backwards (the
    workloads' prompts come from its start) until the chat template makes at least ``tokens`` tokens."""
    turns: list[dict] = []
    for item in reversed(gsm8k_questions(None, data_path)):
        turns += [{"role": "user", "content": item["question"]}, {"role": "assistant", "content": item["answer"]}]
        if len(tokenizer(tokenizer.apply_chat_template(turns, tokenize=False))["input_ids"]) >= tokens:
            return turns
    raise ValueError(f"{data_path} is too short for a history of {tokens} tokens")


def generate_all(engine, prompts: list, params: dict | list[dict], parallel: int, bar=None) -> list[dict]:
    """Every prompt (text, or a list of token ids) through ``engine.async_generate``, at most
    ``parallel`` in flight; ``params`` one sampling-params dict for all or one per prompt. Results in
    prompt order. ``bar`` (a tqdm) advances as answers come back."""
    import anyio

    results: list[dict | None] = [None] * len(prompts)
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)

    async def run() -> None:
        limiter = anyio.CapacityLimiter(parallel)

        async def one(i: int) -> None:
            prompt = {"input_ids": prompts[i]} if isinstance(prompts[i], list) else {"prompt": prompts[i]}
            async with limiter:
                results[i] = await engine.async_generate(sampling_params=per_prompt[i], **prompt)
            if bar is not None:
                bar.update()

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)

    anyio.run(run)
    return results


def command_line() -> str:
    """How this process was started, as something to paste into a shell."""
    module = sys.modules["__main__"].__spec__
    head = ["python", "-m", module.name] if module is not None else ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def machine_info() -> dict:
    """CPU model and capability, core counts, load, library versions and the checkout's commit: what a
    reader of a recorded figure needs to judge it."""
    import torch
    import transformers

    import specjet
    from specjet.kernels.cpu_features import cpu_model, describe_cpu, has_native_bf16

    info = {
        "cpu": cpu_model(),
        "cpu_description": describe_cpu(),  # model, vector ISA, native bf16 or not
        "cpu_native_bf16": has_native_bf16(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specjet": specjet.__version__,
        "git_commit": _git_commit(),
        "kernels": _kernels(),
    }
    return info


def _kernels() -> str:
    """The CPU kernels this process's projections take (a figure changes with them, and SPECJET_BF16_GEMM /
    SPECJET_QGEMM_ISA can force them): bf16 weights' GEMM and quantized weights' kernels."""
    from specjet.kernels import bf16_gemm, qgemm

    try:
        return f"bf16 GEMM {bf16_gemm.default_isa()}, quantized GEMM {qgemm.default_isa()}"
    except ValueError as e:  # a forced set this CPU lacks: the engine will refuse it with this reason
        return f"unavailable ({e})"


def machine_line(machine: dict) -> str:
    """The header's machine line: the CPU with its capability (bf16 figures mean little without it),
    cores, torch threads and load (``load_avg_after`` too where the caller added it)."""
    m = machine
    load = f"load avg {m['load_avg']}"
    if m.get("load_avg_after") is not None:
        load += f" before, {m['load_avg_after']} after"
    return (f"# machine: {m.get('cpu_description', m['cpu'])}; {m['usable_cores']}/{m['cores']} cores usable, "
            f"torch threads {m['torch_threads']}, {load}" + (f", GPU {m['gpu']}" if m["gpu"] else ""))


def report_header_lines(command: str, date: str, machine: dict) -> list[str]:
    """A report's first lines: the command, the date, the machine and the versions. ``machine`` is a
    ``machine_info()`` taken before the run, with ``load_avg_after`` added from one taken after."""
    m = machine
    return [
        f"# command: {command}",
        f"# date: {date}",
        machine_line(m),
        f"# versions: torch {m['torch']}, transformers {m['transformers']}, specjet {m['specjet']}, "
        f"python {m['python']}, commit {m['git_commit']}" + (f"; {m['kernels']}" if m.get("kernels") else ""),
    ]


def _git_commit() -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def compare_outputs(outputs: dict[tuple, list[list[list[int]]]], reference: str, key_names: tuple[str, ...]) -> dict:
    """Greedy outputs must not depend on the configuration. ``outputs`` maps (name, *where) to the
    output ids of each timed pass (per pass, each request's ids); every other name's passes are
    compared, request by request, with ``reference``'s at the same ``where`` and pass index.
    ``key_names`` names the key's parts in the mismatch records.

    Returns {"reference", "identical", "passes" and "requests" (compared), "mismatched_requests",
    "mismatches" (the first 20: the key's parts, run, request, first_differing_token), "per_cell":
    key -> {"requests", "differing"}} (``identity_record`` drops the last, whose keys JSON cannot hold).
    """
    per_cell, mismatches = {}, []
    passes = 0
    for key, runs in outputs.items():
        name, *where = key
        if name == reference:
            continue
        compared = differing = 0
        for run, (got_pass, want_pass) in enumerate(zip(runs, outputs[(reference, *where)])):
            passes += 1
            for i, (got, want) in enumerate(zip(got_pass, want_pass)):
                compared += 1
                if got != want:
                    differing += 1
                    position = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    mismatches.append(dict(zip(key_names, key), run=run, request=i, first_differing_token=position))
        per_cell[key] = {"requests": compared, "differing": differing}
    return {"reference": reference, "identical": not mismatches, "passes": passes,
            "requests": sum(c["requests"] for c in per_cell.values()), "mismatched_requests": len(mismatches),
            "mismatches": mismatches[:20], "per_cell": per_cell}


def identity_record(identity: dict) -> dict:
    """``compare_outputs``' result as a JSON record holds it."""
    return {k: v for k, v in identity.items() if k != "per_cell"}


def fmt_num(x, spec=".1f") -> str:
    """A figure in a report's table; "n/a" where it could not be taken."""
    return "n/a" if x is None else format(x, spec)
