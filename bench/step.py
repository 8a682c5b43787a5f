"""One model forward, no scheduler: how long a decode step (or a verify of N tree nodes) takes for B
requests with L cached tokens each, with the batch-invariant CPU attention and with SDPA.

    python -m bench.step [--batch-size 64] [--context 400] [--nodes 1 [16 ...]] [--repeats 5] [--dtype auto]

The model (``--model-path``, default the embedded one) is loaded once; each request owns L + N
contiguous slots of one KV cache (filled by a prefill of random tokens), and a timed step runs N new
tokens per request (N = 1: decode, logits of the token; N > 1: a chain of N verify nodes under a tree mask,
logits of every node, as the engine's verify needs them) at positions L .. L+N-1, writing the same slots
every time; several N take turns in one process, and each N after the first is also given as a ratio to the
first's median (issue 16's verify-against-decode figure) and as the median of each round's ratio (``paired``:
steadier where the host's speed drifts). Prints the median and min/max of ``--repeats`` steps per path, the
paths taking turns after one warm-up round: ``lists`` (where the model has its C++ layer stack: the whole
forward from host lists in one C++ call, ``LlamaForCausalLM.forward_lists``, the path the engine's decode steps and
verifies take on the CPU), ``invariant`` (the batch-invariant attention from a ``ForwardBatch``; the layers as
one C++ call where the model has its layer stack, kernels/layer_stack.py), ``loop`` (the same kernels called
layer by layer from Python: what the stack saves) and ``sdpa``.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.common import command_line, machine_info, now, report_header_lines
from specjet.arg_types import existing_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, type=existing_path,
                   help="model directory or .gguf (default: the embedded model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="default auto: bfloat16 on a CPU with native bf16 instructions, else float32")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the KV cache's dtype (bfloat16: beside float32 activations, half the bytes a step reads)")
    p.add_argument("--quantization", default=None, choices=["int8", "int4", "gguf"],
                   help="weight-only quantization (gguf: the file's own blocks; needs a .gguf or the default model)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--context", type=int, default=400, help="cached tokens per request (L)")
    p.add_argument("--nodes", type=int, nargs="+", default=[1],
                   help="new tokens per request (N; > 1 = verify a chain); several values take turns in one "
                        "process, each reported with its ratio to the first (a verify against a decode step, "
                        "read within one run on a machine whose speed drifts)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if min(args.batch_size, args.context, *args.nodes, args.repeats) < 1:
        p.error("--batch-size, --context, --nodes and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch
    from transformers import AutoConfig

    from specjet.models.config import ModelConfig
    from specjet.models.forward_batch import ForwardBatch, ForwardMode
    from specjet.models.runner import ModelRunner
    from specjet.models.weights import gguf_source, load_state_dict, resolve_model_path

    machine, date = machine_info(), now()
    model_dir = resolve_model_path(args.model_path)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    b, length, n = args.batch_size, args.context, max(args.nodes)
    runner = ModelRunner(config, load_state_dict(model_dir), args.dtype, "cpu", b * (length + n), 0.0, 1,
                         quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                         gguf_path=gguf_source(args.model_path) if args.quantization == "gguf" else None)
    table = torch.arange(1, b * (length + n) + 1).view(b, length + n)  # slot 0 is the padding slot
    rows = torch.arange(b)

    def forward(mode, positions: torch.Tensor, q_len: int, mask=None, lists: bool = False):
        if lists:  # the engine's CPU path: the whole forward from host lists in one C++ call
            ids = torch.randint(0, config.vocab_size, (b * q_len,)).tolist()
            pos = positions.tolist()
            out = runner.model.forward_lists(ids, pos, pos, rows.tolist(), [q_len] * b, [pos[q_len - 1] + 1] * b,
                                             table, runner.kv_cache, custom_mask=mask)
            if out is None:
                raise SystemExit("bench.step: the lists path needs the C++ layer stack (CPU, extension built)")
            return
        batch = ForwardBatch.build(
            mode, input_ids=torch.randint(0, config.vocab_size, (b * q_len,)), positions=positions,
            out_cache_loc=table[:, positions[:q_len]].reshape(-1), req_to_token=table, req_pool_indices=rows,
            kv_lens=torch.full((b,), int(positions[q_len - 1]) + 1),
            q_lens=torch.full((b,), q_len), custom_mask=mask, logits="last" if q_len == 1 else "all")
        runner.forward(batch)

    forward(ForwardMode.EXTEND, torch.arange(length).repeat(b), length)  # the cached context
    stack = runner.model.layer_stack
    # name -> (batch-invariant attention, the layer stack, the forward from host lists)
    paths = {"invariant": (True, stack, False), "loop": (True, None, False), "sdpa": (False, None, False)}
    if stack is not None:
        paths = {"lists": (True, stack, True), **paths}
    steps = {}  # N -> (mode, positions, mask); every N writes slots L .. L+N-1 of each request
    for nodes in args.nodes:
        positions = torch.arange(length, length + nodes).repeat(b)
        mask = None if nodes == 1 else torch.tril(torch.ones(b, nodes, nodes, dtype=torch.bool))
        steps[nodes] = (ForwardMode.DECODE if nodes == 1 else ForwardMode.VERIFY, positions, mask)
    times: dict[tuple[str, int], list[float]] = {(name, nodes): [] for name in paths for nodes in steps}
    # Round-robin: one step of each path and N per repeat (the first round a warm-up), so a slower stretch
    # of a shared machine falls on every path alike.
    for i in range(args.repeats + 1):
        for nodes, (mode, positions, mask) in steps.items():
            for name, (invariant, use_stack, lists) in paths.items():
                runner.model.set_batch_invariant(invariant)
                runner.model.layer_stack = use_stack
                start = time.perf_counter()
                forward(mode, positions, nodes, mask, lists)
                if i:
                    times[(name, nodes)].append(time.perf_counter() - start)
    stats = {key: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for key, t in times.items()}
    first = args.nodes[0]
    for (name, nodes), t in times.items():
        if nodes != first:  # each round's N-node step over the same round's first step: a host that drifts
            # between minutes moves both alike, so the median of these is steadier than the medians' ratio
            stats[(name, nodes)]["paired_ratio"] = statistics.median(
                a / b for a, b in zip(t, times[(name, first)]))
    runner.model.layer_stack = stack
    machine["load_avg_after"] = machine_info()["load_avg"]
    for line in report_header_lines(command_line(), date, machine):
        print(line)
    dtype = str(runner.dtype).removeprefix("torch.")
    dtype += f" weights {args.quantization}" if args.quantization else ""
    if runner.kv_dtype != runner.dtype:  # e.g. the bf16 cache beside quantized weights (kv_cache_dtype auto)
        dtype += f", {str(runner.kv_dtype).removeprefix('torch.')} KV cache"
    for nodes in steps:
        print(f"# {dtype}, batch {b}, {length} cached tokens per request, {nodes} new token(s) per request")
        ratio_head = f" {'/ N=' + str(first):>8} {'paired':>7}" if nodes != first else ""
        print(f"{'path':<10} {'median ms':>10} {'min':>8} {'max':>8}{ratio_head}")
        for name in paths:
            r = stats[(name, nodes)]
            ratio = (f" {r['median_s'] / stats[(name, first)]['median_s']:>7.2f}x {r['paired_ratio']:>6.2f}x"
                     if nodes != first else "")
            print(f"{name:<10} {1000 * r['median_s']:>10.1f} {1000 * r['min_s']:>8.1f} {1000 * r['max_s']:>8.1f}{ratio}")
    if len(steps) == 1:
        return {name: stats[(name, first)] for name in paths}
    return {name: {nodes: stats[(name, nodes)] for nodes in steps} for name in paths}


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
