"""The server's counters and ``GET /metrics`` in Prometheus' text format (version 0.0.4)."""
from __future__ import annotations

import threading
from collections import Counter
from typing import Any

PREFIX = "specjet"


class Metrics:
    """Counts what the endpoints answer; the engine's own gauges are read when /metrics is asked."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = Counter()  # finish reason -> requests (stop, length, tool_calls, abort, error)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.refused = Counter()  # (HTTP status, error code) -> requests answered with an error before any engine work

    def record_refused(self, status: int, code: str | None) -> None:
        """A request refused at the door (a 400 for a bad body, a 503 for a full queue, a 401): no finish reason of
        its own, so an operator sees the refusal rate here."""
        with self._lock:
            self.refused[(int(status), code or "error")] += 1

    def record(self, finish_reason: str | None, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        with self._lock:
            self.requests[finish_reason or "abort"] += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def tally(self, n: int) -> "ChoiceTally":
        """A counter for one response's choices, ``n`` a prompt."""
        return ChoiceTally(self, n)

    def render(self, engine) -> str:
        info: dict[str, Any] = engine.get_server_info()
        stats = info["stats"]
        scheduler = engine.scheduler
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {PREFIX}_{name} {help_text}")
            lines.append(f"# TYPE {PREFIX}_{name} {kind}")
            for labels, value in samples:
                lines.append(f"{PREFIX}_{name}{labels} {float(value):g}")

        with self._lock:
            by_reason = sorted(self.requests.items())
            refused = sorted(self.refused.items())
            prompt, completion = self.prompt_tokens, self.completion_tokens
        metric("requests_total", "counter", "Requests answered, by finish reason.",
               [(f'{{finish_reason="{reason}"}}', n) for reason, n in by_reason])
        metric("requests_refused_total", "counter", "Requests refused before any engine work, by status and code.",
               [(f'{{status="{status}",code="{code}"}}', n) for (status, code), n in refused])
        metric("prompt_tokens_total", "counter", "Prompt tokens of answered requests (engine aborts included).",
               [("", prompt)])
        metric("generation_tokens_total", "counter", "Completion tokens of answered requests (engine aborts included).",
               [("", completion)])
        # len() of the scheduler's lists is one atomic read each; a glimpse, not a snapshot.
        metric("num_running_reqs", "gauge", "Requests running in the engine.", [("", len(scheduler.running))])
        metric("num_queue_reqs", "gauge", "Requests waiting in the engine.", [("", len(scheduler.waiting))])
        metric("kv_pool_size", "gauge", "KV cache slots in the pool.", [("", info["kv_pool_size"])])
        metric("kv_free_slots", "gauge", "KV cache slots free.", [("", info["kv_free"])])
        used = 1.0 - info["kv_free"] / info["kv_pool_size"] if info["kv_pool_size"] else 0.0
        metric("kv_usage", "gauge", "Fraction of the KV pool in use.", [("", used)])
        cache = info.get("radix_cache") or {}
        metric("kv_cached_slots", "gauge", "KV cache slots held by the prefix cache.",
               [("", cache.get("cached_tokens", 0))])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache, as a fraction.",
               [("", cache.get("hit_rate", 0.0))])
        metric("engine_alive", "gauge", "1 while the engine's scheduler runs.", [("", int(info["alive"]))])
        metric("request_errors_total", "counter", "Requests the engine ended with an internal error.",
               [("", stats.get("request_errors", 0))])
        metric("batch_failures_total", "counter", "Batches that failed on the compute side.",
               [("", stats.get("batch_failures", 0))])
        metric("requests_isolated_total", "counter",
               "Requests of failed batches re-run alone to find the one a fault follows.",
               [("", stats.get("requests_isolated", 0))])
        metric("num_queued_not_started", "gauge", "Requests submitted and not yet started (max_queued_requests).",
               [("", info.get("queued_requests", 0))])
        grammar = info.get("grammar") or {}
        metric("grammar_compiles_total", "counter", "Grammar compiles run (cache misses).",
               [("", grammar.get("compiles", 0))])
        metric("grammar_compile_seconds_total", "counter", "Seconds spent compiling grammars.",
               [("", grammar.get("compile_seconds", 0.0))])
        if "spec_accept_length" in stats:
            metric("spec_accept_length", "gauge", "Mean tokens accepted per speculative verify.",
                   [("", stats["spec_accept_length"])])
            metric("spec_verify_total", "counter", "Speculative verify steps.", [("", stats["spec_verify_ct"])])
        return "\n".join(lines) + "\n"


class ChoiceTally:
    """One response's choices in the metrics, ``n`` a prompt (prompt-major: choice i is prompt i // n's): each
    prompt's tokens counted once, with the first of its choices to end, whether it finished or was refused."""

    def __init__(self, metrics: Metrics, n: int) -> None:
        self._metrics, self._n = metrics, n
        self._counted: set[int] = set()

    def record(self, finish_reason: str | None, meta: dict, index: int) -> None:
        prompt = index // self._n
        prompt_tokens = 0 if prompt in self._counted else meta.get("prompt_tokens", 0)
        self._counted.add(prompt)
        self._metrics.record(finish_reason, prompt_tokens, meta.get("completion_tokens", 0))
