"""``python -m bench.serve``: a live ``specjet serve`` on loopback, driven by the official ``openai``
client (in the spirit of SGLang's bench_serving).

For each configuration (``none``: no speculation, ``--disable-guided-drafting``; ``default``: the engine's
defaults, which draft under a grammar; ``EAGLE`` / ``NGRAM``: that algorithm) a server is started in a
subprocess on a free loopback port; the workloads run at each concurrency:

- ``json``: JSON-schema prompts of the dev set with ``response_format`` json_schema;
- ``tools``: agent-style prompts with three tools and ``tool_choice="required"``;
- ``agent``: the ``tools`` requests behind one long shared system prompt (an agent's policy and
  its tool catalogue, about 1,000 tokens), what the prefix cache is for.

Every request streams (``stream_options.include_usage``): TTFT is the time to the first chunk
with content or a tool-call delta, e2e the time to the last, TPOT (e2e - TTFT) / (tokens - 1).
Valid: the content validates against the schema (json), the call names a given tool and its
arguments validate against that tool's parameters (tools). Bounded: ``--num-requests`` per cell
and ``--cell-timeout`` seconds per cell (a cell cut there keeps the requests that finished, counts the rest as
cut and has no tokens/s); loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.common import (JSONSCHEMA_DIR, append_jsonl, command_line, fmt_num, jsonschema_prompts, machine_info, now,
                          report_header_lines)
from specjet.arg_types import existing_path

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a date",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string"}, "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "date", "passengers"]}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
            "required": ["amount", "from_currency", "to_currency"]}}},
]
TOOL_PROMPTS = [
    "What's the weather like in Lisbon right now, in celsius?",
    "Find me a flight from Boston to Denver on 2026-12-03 for two people.",
    "How many euros is 250 US dollars?",
    "Is it cold in Oslo today? Use fahrenheit.",
    "I need a flight from Paris to Rome on March 5th 2027, just me.",
    "Convert 1200 Japanese yen to British pounds.",
    "Tell me the weather in Nairobi in celsius.",
    "Book-search flights SFO to JFK on 2026-11-30 for 4 passengers.",
]
CONFIGS = {"none": ["--disable-guided-drafting"], "default": [],
           "EAGLE": ["--speculative-algorithm", "EAGLE"], "NGRAM": ["--speculative-algorithm", "NGRAM"],
           "none-nocache": ["--disable-guided-drafting", "--disable-radix-cache"],
           "EAGLE-nocache": ["--speculative-algorithm", "EAGLE", "--disable-radix-cache"]}
AGENT_TOPICS = ["weather", "flights", "currency", "refunds", "privacy", "escalation", "dates", "units"]


def agent_system_prompt() -> str:
    """A long, fixed system prompt: an agent policy, one paragraph per topic, and the tool catalogue."""
    rules = [f"Policy {i + 1} ({topic}): when a request concerns {topic}, first decide whether one of the "
             f"tools below answers it; if it does, call that tool with every required argument filled from "
             f"the user's words, never invent values the user did not give, keep units and currencies "
             f"exactly as stated, and prefer a single precise call over several vague ones. If the request "
             f"about {topic} is unclear, still call the closest tool with the most likely reading."
             for i, topic in enumerate(AGENT_TOPICS)]
    catalogue = json.dumps([t["function"] for t in TOOLS], indent=1)
    return ("You are TravelDesk, the assistant of a travel agency. Follow these policies.\n\n" + "\n".join(rules)
            + "\n\nTool catalogue:\n" + catalogue)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, type=existing_path,
                        help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default=None, help="engine dtype (default: the engine's auto)")
    parser.add_argument("--configs", nargs="+", default=["none", "EAGLE"], choices=list(CONFIGS))
    parser.add_argument("--workloads", nargs="+", default=["json", "tools"], choices=["json", "tools", "agent"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--num-requests", type=int, default=16, help="requests per (workload, concurrency) cell")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--schema-dir", default=str(JSONSCHEMA_DIR))
    parser.add_argument("--cell-timeout", type=float, default=600.0, help="seconds a cell may take before it is cut")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for `specjet serve` (repeatable)")
    parser.add_argument("--result-file", default=None, help="append a JSON record to this .jsonl file")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.num_requests < 1 or args.max_tokens < 1:
        parser.error("--concurrency, --num-requests and --max-tokens must be >= 1")
    return args


# ---------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m specjet.serve`` in a subprocess on a free loopback port."""

    def __init__(self, flags: list[str], timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specjet.serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--debug-endpoints", *flags]  # /debug/kv: the KV invariant after the run
        # Its output goes to a file: a pipe nobody reads while the run goes on fills, and the server's next log
        # line (a failing request's traceback, say) would then block it for good.
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, HF_HUB_OFFLINE="1"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench.serve: the server exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.close()
        raise SystemExit(f"bench.serve: the server did not come up within {timeout:.0f} s")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of what the server has written (its log and any traceback)."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def kv_check(self) -> dict:
        """Waits until the server is idle and checks the KV invariant (free + owned == pool)."""
        with urllib.request.urlopen(self.url + "/debug/kv", timeout=120) as r:
            return json.loads(r.read())

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------- the requests
def json_requests(args) -> list[dict]:
    items = jsonschema_prompts(folder=args.schema_dir)
    out = []
    for i in range(args.num_requests):
        item = items[i % len(items)]
        schema = json.loads(item["schema"])
        out.append({"messages": [{"role": "user", "content": item["prompt"]}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": schema, "strict": True}},
                    "_check": ("json", schema)})
    return out


def tool_requests(args, system: str | None = None) -> list[dict]:
    head = [{"role": "system", "content": system}] if system else []
    return [{"messages": head + [{"role": "user", "content": TOOL_PROMPTS[i % len(TOOL_PROMPTS)]}], "tools": TOOLS,
             "tool_choice": "required", "_check": ("tools", None)} for i in range(args.num_requests)]


def is_valid(kind: str, schema, content: str, calls: dict[int, dict]) -> bool:
    import jsonschema

    try:
        if kind == "json":
            jsonschema.validate(json.loads(content), schema)
            return True
        if not calls:
            return False
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in calls.values():
            if call["name"] not in params:
                return False
            jsonschema.validate(json.loads(call["arguments"]), params[call["name"]])
        return True
    except (ValueError, jsonschema.ValidationError, jsonschema.SchemaError):
        return False


async def one_request(client, model: str, request: dict, max_tokens: int) -> dict:
    kind, schema = request["_check"]
    body = {k: v for k, v in request.items() if not k.startswith("_")}
    start = time.perf_counter()
    ttft, content, calls, tokens, error = None, [], {}, 0, None
    try:
        stream = await client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                                                      stream_options={"include_usage": True}, **body)
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    content.append(delta.content)
                for tc in delta.tool_calls or []:
                    call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function is not None:
                        call["name"] += tc.function.name or ""
                        call["arguments"] += tc.function.arguments or ""
                if ttft is None and (delta.content or delta.tool_calls):
                    ttft = time.perf_counter() - start
    except Exception as exc:  # counted, not fatal: the table shows the errors
        error = f"{type(exc).__name__}: {exc}"
    e2e = time.perf_counter() - start
    text = "".join(content)
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens, "error": error,
            "valid": error is None and is_valid(kind, schema, text, calls),
            "tpot": (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None}


async def run_cell(url: str, requests: list[dict], concurrency: int, max_tokens: int, timeout: float) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)
    model = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(concurrency)

    async def gated(req):
        async with gate:
            return await one_request(client, model, req, max_tokens)

    start = time.perf_counter()
    tasks = [asyncio.ensure_future(gated(r)) for r in requests]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:  # past the cell's time: what finished is kept, the rest is counted as cut
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    wall = time.perf_counter() - start
    await client.close()
    return summarize([t.result() for t in tasks if t in done], wall, len(pending))


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(results: list[dict], wall: float, cut: int) -> dict:
    """A cell's figures over the requests that finished; ``cut``: how many the cell's timeout ended (a cut
    cell's tokens/s is None: its wall time is the timeout's, not the requests')."""
    ok = [r for r in results if r["error"] is None]
    figures = {}
    for key in ("ttft", "tpot", "e2e"):
        values = [r[key] for r in ok if r[key] is not None]
        figures[key] = {"p50": _pct(values, 0.5), "p99": _pct(values, 0.99)}
    return {"requests": len(results), "errors": len(results) - len(ok), "cut": cut,
            "valid": sum(r["valid"] for r in results), "wall_s": wall,
            "output_tok_s": sum(r["tokens"] for r in ok) / wall if wall > 0 and not cut else None,
            "first_error": next((r["error"] for r in results if r["error"]), None), **figures}


def accept_length(metrics_text: str) -> float | None:
    for line in metrics_text.splitlines():
        if line.startswith("specjet_spec_accept_length"):
            try:
                return float(line.split()[-1])
            except ValueError:
                return None
    return None


# ---------------------------------------------------------------- the run
def run(args) -> dict:
    workloads = {"json": json_requests(args) if "json" in args.workloads else None,
                 "tools": tool_requests(args) if "tools" in args.workloads else None,
                 "agent": tool_requests(args, agent_system_prompt()) if "agent" in args.workloads else None}
    cells = []
    for config in args.configs:
        flags = list(CONFIGS[config]) + list(args.server_arg)
        if args.model_path:
            flags += ["--model-path", args.model_path]
        if args.dtype:
            flags += ["--dtype", args.dtype]
        server = Server(flags)
        try:
            # A warm-up request unlike every workload's (no prefix of theirs reaches the cache).
            warm = [{"messages": [{"role": "user", "content": "Say hello."}], "_check": ("text", None)}]
            asyncio.run(run_cell(server.url, warm, 1, 8, args.cell_timeout))
            for name in args.workloads:
                for conc in args.concurrency:
                    cell = asyncio.run(run_cell(server.url, workloads[name], conc, args.max_tokens, args.cell_timeout))
                    cell.update(config=config, workload=name, concurrency=conc)
                    cells.append(cell)
                    print(row_line(cell), flush=True)
            if any(c["errors"] for c in cells if c["config"] == config):  # what the server said about them
                print(f"# the {config} server's log ends:\n{server.log_tail()}", file=sys.stderr)
            accept = accept_length(server.metrics())
            kv = server.kv_check()
            for cell in cells:
                if cell["config"] == config:
                    cell["server_accept_length"] = accept
                    cell["kv_after"] = kv
        finally:
            server.close()
    return {"cells": cells}


HEADER = (f"{'config':<13} {'workload':<8} {'conc':>4} {'reqs':>5} {'valid':>6} {'errors':>6} "
          f"{'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'p99':>7} {'e2e p50':>8} {'p99':>7} {'out tok/s':>9}")


def row_line(c: dict) -> str:
    ms = lambda x: fmt_num(None if x is None else 1e3 * x)  # noqa: E731
    s = lambda x: fmt_num(x, ".2f")  # noqa: E731
    cut = f"  ({c['cut']} cut at the cell timeout)" if c["cut"] else ""
    return (f"{c['config']:<13} {c['workload']:<8} {c['concurrency']:>4} {c['requests']:>5} "
            f"{c['valid']:>3}/{c['requests']:<2} {c['errors']:>6} {ms(c['ttft']['p50']):>9} {ms(c['ttft']['p99']):>7} "
            f"{ms(c['tpot']['p50']):>9} {ms(c['tpot']['p99']):>7} {s(c['e2e']['p50']):>8} {s(c['e2e']['p99']):>7} "
            f"{fmt_num(c['output_tok_s']):>9}{cut}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    command, date, machine = command_line(), now(), machine_info()
    for line in report_header_lines(command, date, machine):
        print(line)
    print(f"# {args.num_requests} requests per cell, greedy, at most {args.max_tokens} tokens, streamed; "
          f"TTFT/TPOT in ms, e2e in s; valid = schema-valid content (json) / a call to a given tool whose "
          f"arguments validate (tools)")
    print(HEADER, flush=True)
    result = run(args)
    for config in args.configs:
        first = next(c for c in result["cells"] if c["config"] == config)
        if first.get("server_accept_length") is not None:
            print(f"accept length {config}: {first['server_accept_length']:.2f}")
        kv = first["kv_after"]
        print(f"KV after {config}: {'ok' if kv.get('ok') else 'LEAK'} ({kv['kv_free']} free, "
              f"{kv.get('kv_cached', 0)} in the prefix cache, of {kv['kv_pool_size']})")
    if "none" in args.configs:
        base = {(c["workload"], c["concurrency"]): c["output_tok_s"] for c in result["cells"] if c["config"] == "none"}
        for c in result["cells"]:
            ref = base.get((c["workload"], c["concurrency"]))
            if c["config"] != "none" and ref and c["output_tok_s"]:
                print(f"speed-up {c['config']}/none {c['workload']} conc {c['concurrency']}: "
                      f"{c['output_tok_s'] / ref:.2f}x")
    errors = [c["first_error"] for c in result["cells"] if c["first_error"]]
    if errors:
        print(f"first error: {errors[0]}")
    record = {"command": command, "date": date, "machine": machine, **result}
    if args.result_file:
        append_jsonl(args.result_file, record)
    return record


if __name__ == "__main__":
    from bench.common import run_cli

    run_cli(main)
