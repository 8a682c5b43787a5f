"""Decode tokens/s of specjet against Hugging Face transformers ``generate``, and of speculative
decoding (EAGLE, NGRAM) against plain decoding, at batch sizes 1 and 8.

    python -m bench.latency [--batch-sizes 1 8] [--max-new-tokens 64] [--repeats 3] [--num-prompts 8]
                            [--workload gsm8k json] [--json-constrained] [--skip-hf] [--llamacpp]
                            [--speculative-algorithm EAGLE|NGRAM [--speculative-num-steps S] ...]
                            [--sweep [--sweep-num-steps ...]] [--result-file bench/out/latency.jsonl]
                            [engine flags]

All systems load the same model (the model directory ``resolve_model_path(--model-path)``) and compute in
``--dtype`` (default auto: bf16 on a CPU with native bf16 instructions, else fp32): specjet with the weights
``--quantization`` gives it (default auto: a GGUF model's own quantized blocks, as llama.cpp reads them; the
header says which), transformers with the float weights. All get the same
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

``--llamacpp`` also times llama.cpp (llama-cpp-python, the ``bench-llamacpp`` extra; bench/llamacpp_system.py)
on the GGUF file the model comes from, greedy (top-k 1), at batch size 1 only (it decodes one sequence
at a time), with its own JSON-schema grammar under ``--json-constrained``, and prints specjet's ratio
to it. Its threads: torch's count.

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
import math
import statistics
import sys

from bench import llamacpp_system
from bench.common import engine_kwargs, fmt_num, identity_record, without_speculation
from bench.decode_rate import Measurement, Prompt, SpecjetSystem, make_batches, timed_run, warm_up
from bench.engine_info import spec_str
from bench.latency_common import (Workload, finish, header_lines, identity_check, identity_line, make_header,
                                  parse_args, prepare, workload_heading)
from bench.spec_sweep import run_sweep

PLAIN = "specjet"


# ---------------------------------------------------------------- the systems (specjet's: bench/decode_rate.py)
def describe_spec(desc: dict) -> str:
    """``SpecjetSystem.describe()`` in one line: the engine's settings, then where the drafts come from."""
    if desc["algorithm"] in ("EAGLE", "DFLASH"):
        return f"{spec_str(desc)}, {'head' if desc['algorithm'] == 'EAGLE' else 'draft'} {desc['draft_model_path']}"
    window = desc.get("match_window") or [None, None]
    return f"{spec_str(desc)}, match window {window[0]}-{window[1]}"


class HFSystem:
    """transformers' ``generate`` with SpecjetSystem's interface (no output ids, no speculation)."""
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


LLAMACPP = llamacpp_system.LlamaCppSystem.name


def _gguf_file(args: argparse.Namespace):
    from specjet.models.weights import gguf_source

    path = gguf_source(args.model_path)
    if path is None:
        raise SystemExit("--llamacpp needs a GGUF model (the default model, or --model-path file.gguf)")
    return path


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ---------------------------------------------------------------- measuring
def measure(systems, workloads: list[Workload], args: argparse.Namespace) -> list[Measurement]:
    """Every (system, workload, batch size), runs interleaved."""
    from tqdm.auto import tqdm

    n = args.max_new_tokens
    batches = {(w.name, bs): make_batches(w.prompts, bs) for w in workloads for bs in args.batch_sizes}
    cells = [(w, bs, s) for w in workloads for bs in args.batch_sizes for s in systems
             if bs <= getattr(s, "max_batch_size", bs) and s.supports(w)]
    table = {(s.name, w.name, bs): Measurement(s.name, w.name, bs, sum(map(len, batches[(w.name, bs)])))
             for w, bs, s in cells}
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
                timed_run(system, batches[(w.name, bs)], n, m)
                rate = m.rates[-1]
                bar.set_postfix_str(f"{rate:.1f} tok/s" if not math.isnan(rate) else "t_N <= t_1")
                bar.update()
    return list(table.values())


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
        if LLAMACPP in systems:
            f["specjet_over_llamacpp"] = {str(bs): _ratio(median[(PLAIN, workload, bs)],
                                                          median.get((LLAMACPP, workload, bs))) for bs in sizes
                                          if (LLAMACPP, workload, bs) in median}
            if spec:
                f["spec_over_llamacpp"] = {str(bs): _ratio(median[(spec, workload, bs)],
                                                           median.get((LLAMACPP, workload, bs))) for bs in sizes
                                           if (LLAMACPP, workload, bs) in median}
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
                            for bs in sizes[1:] if (s, workload, bs) in median} for s in systems}
        out[workload] = f
    return out


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
        order = {PLAIN: 0, "HF": 2, LLAMACPP: 3}
        for x in sorted(rows, key=lambda x: (x.batch_size, order.get(x.system, 1))):
            s = x.summary()
            row = (f"{x.system:<14} {x.batch_size:>5} {fmt_num(s['median']):>12} {fmt_num(s['min']):>8} "
                   f"{fmt_num(s['max']):>8} {statistics.median(x.t_1):>8.3f} {statistics.median(x.t_n):>8.3f}")
            if x.accept_length is not None:
                row += f" {x.accept_length:>7.2f}"
            lines.append(row.rstrip())
        if "speedup" in f:
            name = header["speculative_system"]
            lines.append(f"speed-up {name}/{PLAIN}: " + ", ".join(f"bs{bs} {fmt_num(r, '.2f')}x"
                                                              for bs, r in f["speedup"].items()))
            lines.append(f"accept length {name}: " + ", ".join(f"bs{bs} {fmt_num(a, '.2f')}"
                                                             for bs, a in f["accept_length"].items()))
        if "specjet_over_llamacpp" in f:
            lines.append("specjet/llama.cpp: " + ", ".join(f"bs{bs} {fmt_num(r, '.2f')}x"
                                                           for bs, r in f["specjet_over_llamacpp"].items()))
        if "spec_over_llamacpp" in f:
            lines.append(f"{header['speculative_system']}/llama.cpp: " + ", ".join(
                f"bs{bs} {fmt_num(r, '.2f')}x" for bs, r in f["spec_over_llamacpp"].items()))
        if "specjet_over_hf" in f:
            lines.append("specjet/HF: " + ", ".join(f"bs{bs} {fmt_num(r, '.2f')}x"
                                                    for bs, r in f["specjet_over_hf"].items()))
        if "spec_over_hf" in f:
            lines.append(f"{header['speculative_system']}/HF: " + ", ".join(f"bs{bs} {fmt_num(r, '.2f')}x"
                                                                           for bs, r in f["spec_over_hf"].items()))
        for system, per_size in f["scaling"].items():
            if per_size:
                lines.append(f"scaling {system}: " + ", ".join(f"bs{k.replace('/', '/bs')} {fmt_num(r, '.2f')}x"
                                                               for k, r in per_size.items()))
    if identity is not None:
        lines += ["", identity_line(identity, f"{header['speculative_system']} vs {PLAIN}, greedy")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    setup = prepare(args)
    workloads, context = setup.workloads, setup.context
    if args.sweep:
        return run_sweep(args, workloads, context)

    kwargs = engine_kwargs(args)
    spec_name = f"{PLAIN}+{args.speculative_algorithm}" if args.speculative_algorithm else None
    if args.llamacpp:
        llamacpp_system.require()
    names = [PLAIN] + ([spec_name] if spec_name else []) + (["HF"] if setup.hf else []) \
        + ([LLAMACPP] if args.llamacpp else [])
    print(f"loading {', '.join(names)} from {context['model_dir']} ...", file=sys.stderr)
    systems = []
    try:
        systems.append(SpecjetSystem(PLAIN, without_speculation(kwargs)))
        if spec_name:
            systems.append(SpecjetSystem(spec_name, kwargs))
        if setup.hf:
            systems.append(HFSystem(**setup.hf))
        if args.llamacpp:
            systems.append(llamacpp_system.LlamaCppSystem(_gguf_file(args), torch_threads()))
        spec_desc = systems[1].describe() if spec_name else None
        measurements = measure(systems, workloads, args)
    finally:
        for system in systems:
            system.close()

    header = make_header("latency", context, workloads, args)
    skipped = next((s.skipped for s in systems if s.name == LLAMACPP), set())
    if skipped:
        header["llamacpp_skipped_schemas"] = len(skipped)
    if spec_name:
        header.update(speculative=spec_desc, speculative_system=spec_name)
    identity = identity_check(measurements, PLAIN) if spec_name else None
    figs = figures(measurements)
    record = dict(header, args=vars(args), figures=figs,
                  outputs_identical=identity_record(identity) if identity else None,
                  results=[m.record() for m in measurements])
    return finish(record, format_report(header, measurements, figs, identity), args)


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
