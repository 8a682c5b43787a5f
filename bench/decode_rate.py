"""The decode-rate measurement that bench.latency (with its --sweep) and bench.compare share.

The prompts are cycled up to a multiple of the batch size B and cut into batches of B; one *pass*
runs all batches one after the other. A run times two passes over the same batches, t_1 with
max_new_tokens=1 (prefill and first token only) and t_N with N, and

    decode tokens/s = decode tokens (after each request's first) / (t_N - t_1)

so that whatever both passes share (tokenizing, prefill, scheduling and returning a request)
cancels, with a wall clock outside every system. Around the N-token pass the engine's speculative
running totals are read (outside the timing), which gives the accept length of that pass.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

from bench.engine_info import describe_engine, spec_totals


@dataclass
class Prompt:
    ids: list[int]
    json_schema: str | None = None  # set: decoded under this schema (json_schema)


def make_batches(prompts: list, batch_size: int) -> list[list]:
    """The prompts, cycled up to a multiple of ``batch_size`` so every batch is full, in batches."""
    count = math.ceil(len(prompts) / batch_size) * batch_size
    cycled = [prompts[i % len(prompts)] for i in range(count)]
    return [cycled[i:i + batch_size] for i in range(0, count, batch_size)]


class SpecjetSystem:
    """A specjet engine as a timed system: exactly N tokens per request, EOS ignored (``stop_at_eos``: a reply
    ends at EOS or at N); greedy, or drawn with ``sampling`` (temperature, top_p, top_k, min_p, and a seed:
    request i of a batch gets seed + i)."""

    def __init__(self, name: str, kwargs: dict, sampling: dict | None = None, stop_at_eos: bool = False):
        import specjet

        self.name = name
        self.kwargs = kwargs
        self.sampling = dict(sampling or {})
        self.stop_at_eos = stop_at_eos
        self.algorithm = kwargs.get("speculative_algorithm")
        self.engine = specjet.Engine(**kwargs)

    def supports(self, workload) -> bool:
        return True

    def generate(self, batch: list[Prompt], max_new_tokens: int) -> list[dict]:
        seed = self.sampling.get("seed")
        sampling = {k: v for k, v in self.sampling.items() if k != "seed"}
        params = [dict({"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": not self.stop_at_eos},
                       **sampling,
                       **({"seed": seed + i} if seed is not None else {}),
                       **({"json_schema": p.json_schema} if p.json_schema is not None else {}))
                  for i, p in enumerate(batch)]
        outs = self.engine.generate(input_ids=[p.ids for p in batch], sampling_params=params)
        for prompt, out in zip(batch, outs):  # a short or aborted request would make the figure meaningless
            got, reason = out["meta_info"]["completion_tokens"], out["meta_info"]["finish_reason"]
            # Under a schema a request stops when its object is complete, and at EOS where EOS ends a reply,
            # but never aborts.
            ends_early = prompt.json_schema is not None or self.stop_at_eos
            ok = 1 <= got <= max_new_tokens and reason["type"] != "abort" if ends_early else got == max_new_tokens
            if not ok:
                raise RuntimeError(f"{self.name} returned {got} tokens, not {max_new_tokens}: {reason}")
        return outs

    def spec_totals(self) -> tuple[int, int] | None:
        """The engine's running (verify forwards, accepted tokens); None without speculation."""
        return spec_totals(self.engine)

    def iteration_timings(self) -> dict:
        """Since the last call (the engine's timings then start afresh): ``spec_phases``, the mean ms
        per speculative iteration of each phase (None without speculation), and ``overlap``, the
        loop's decode-iteration figures (plain decoding: the median forward and iteration)."""
        stats = self.engine.get_server_info(reset_timings=True)["stats"]
        return {"spec_phases": stats.get("spec_phases"), "overlap": stats.get("overlap")}

    def describe(self) -> dict | None:
        """The speculative configuration in effect (the engine's defaults filled in), with the EAGLE
        head's directory."""
        if not self.algorithm:
            return None
        desc = describe_engine(self.engine)["speculative"]
        if self.algorithm in ("EAGLE", "DFLASH"):
            desc["draft_model_path"] = str(self.engine.worker.speculator.draft_model_dir)
        return desc

    def close(self) -> None:
        self.engine.shutdown()


@dataclass
class Measurement:
    """One system at one workload and batch size: the raw figures of its timed runs."""
    system: str
    workload: str
    batch_size: int
    requests: int  # per pass: the prompts rounded up to a multiple of batch_size
    t_1: list[float] = field(default_factory=list)  # seconds per pass, max_new_tokens=1
    t_n: list[float] = field(default_factory=list)  # seconds per pass, max_new_tokens=N
    decode_tokens: list[int] = field(default_factory=list)  # per N-token pass: tokens after each request's first
    verify_ct: list[int] = field(default_factory=list)  # speculative: verify forwards per N-token pass
    accepted: list[int] = field(default_factory=list)  # speculative: tokens they committed
    histogram: dict[int, int] = field(default_factory=dict)  # tokens committed per verify -> count, all passes
    outputs: list[list[list[int]]] = field(default_factory=list)  # per N-token pass: each request's output ids
    phases: list[dict] = field(default_factory=list)  # speculative: per N-token pass, mean ms per iteration by phase
    # plain decoding: per N-token pass, the median decode iteration and model forward (ms)
    iterations: list[dict] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        """Decode tokens/s of each run; NaN where noise made t_N <= t_1."""
        return [tokens / (n - one) if n > one else math.nan
                for one, n, tokens in zip(self.t_1, self.t_n, self.decode_tokens)]

    @property
    def accept_lengths(self) -> list[float]:
        return [a / v for a, v in zip(self.accepted, self.verify_ct) if v]

    @property
    def accept_length(self) -> float | None:
        """Accepted tokens / verify forwards over every timed N-token pass."""
        return sum(self.accepted) / sum(self.verify_ct) if sum(self.verify_ct) else None

    def summary(self) -> dict:
        valid = [r for r in self.rates if not math.isnan(r)]
        return {
            "median": statistics.median(valid) if valid else None,
            "min": min(valid) if valid else None,
            "max": max(valid) if valid else None,
        }

    def record(self) -> dict:
        out = {"system": self.system, "workload": self.workload, "batch_size": self.batch_size,
               "requests": self.requests, "decode_tok_s": self.summary(),
               "runs_decode_tok_s": [None if math.isnan(r) else r for r in self.rates],
               "t_1_s": self.t_1, "t_n_s": self.t_n, "decode_tokens": self.decode_tokens}
        if any(self.verify_ct):  # (an engine without speculation verifies only guided requests, if any)
            out.update(accept_length=self.accept_length, runs_accept_length=self.accept_lengths,
                       verify_ct=self.verify_ct, accepted_tokens=self.accepted,
                       accept_histogram={str(k): v for k, v in sorted(self.histogram.items())})
        if self.phases:  # the median over passes of each phase's mean ms per iteration
            out["spec_phases_ms"] = {k: statistics.median(p[k] for p in self.phases)
                                     for k in self.phases[0] if k.endswith("_ms")}
            if all("tree_nodes" in p for p in self.phases):  # a request's verify tree, root included
                out["tree_nodes"] = statistics.median(p["tree_nodes"] for p in self.phases)
        if self.iterations:  # the median over passes of each pass's medians
            out["plain_iteration_ms"] = {k: statistics.median(it[k] for it in self.iterations)
                                         for k in ("iteration_ms_median", "forward_ms_median")}
        return out


def timed_pass(system, batches, max_new_tokens: int) -> tuple[float, list[dict] | None]:
    """Seconds for all batches, and the results (None for a system that returns none, as HF)."""
    results = []
    start = time.perf_counter()
    for batch in batches:
        outs = system.generate(batch, max_new_tokens)
        if outs is not None:
            results.extend(outs)
    return time.perf_counter() - start, (results if results else None)


def warm_up(system, batches, max_new_tokens: int) -> None:
    """One batch with N tokens, then every batch with 1 (so each prompt's schema, if any, is compiled
    and cached before the timing, and both timed passes find the same cache)."""
    system.generate(batches[0], max_new_tokens)
    timed_pass(system, batches, 1)


def timed_run(system, batches, max_new_tokens: int, m: Measurement) -> None:
    """One run into ``m``: the 1-token pass, then the N-token pass with the system's speculative
    totals read around it (outside the timing), and that pass's output ids (none for HF)."""
    n = max_new_tokens
    t_1, _ = timed_pass(system, batches, 1)
    timings = getattr(system, "iteration_timings", lambda: {})
    timings()  # start the engine's timings afresh
    before = system.spec_totals()
    t_n, outs = timed_pass(system, batches, n)
    after = system.spec_totals()
    spent = timings()
    if spent.get("spec_phases") and spent["spec_phases"]["iterations"]:
        m.phases.append(spent["spec_phases"])
    if spent.get("overlap") and "forward_ms_median" in spent["overlap"]:
        m.iterations.append(spent["overlap"])
    m.t_1.append(t_1)
    m.t_n.append(t_n)
    if outs is None:  # HF generates exactly N per request or raises
        m.decode_tokens.append(m.requests * (n - 1))
        return
    m.decode_tokens.append(sum(o["meta_info"]["completion_tokens"] - 1 for o in outs))
    if before is not None:
        m.verify_ct.append(after[0] - before[0])
        m.accepted.append(after[1] - before[1])
        for o in outs:
            for k, count in o["meta_info"].get("spec_accept_histogram", {}).items():
                m.histogram[int(k)] = m.histogram.get(int(k), 0) + count
    m.outputs.append([o["output_ids"] for o in outs])
