"""`python -m bench.serve`: validity of hand-made replies, the percentile summary, and the CLI end to
end against real `specjet serve` subprocesses (tiny random model)."""
from __future__ import annotations

import json
import re
import sys
import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # bench/ is not installed
    sys.path.insert(0, str(REPO_ROOT))

from bench.serve import TOOLS, agent_system_prompt, is_valid, main, parse_args, summarize, tool_requests

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("kind, content, calls, valid", [
    ("json", '{"n": 3}', {}, True),
    ("json", '{"n": "3"}', {}, False),
    ("json", '{"n": 3', {}, False),
    ("tools", "", {0: {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}, True),
    ("tools", "", {0: {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}, False),  # unit required
    ("tools", "", {0: {"name": "launch_rocket", "arguments": "{}"}}, False),  # not a given tool
    ("tools", "sure!", {}, False),  # no call at all
])
def test_validity(kind, content, calls, valid):
    assert is_valid(kind, SCHEMA, content, calls) is valid
    assert TOOLS[0]["function"]["name"] == "get_weather"


def test_summary_percentiles_and_rate():
    results = [{"ttft": t, "tpot": 0.01 * t, "e2e": 2 * t, "tokens": 10, "error": None, "valid": t < 3}
               for t in (1.0, 2.0, 3.0, 4.0)] + [{"ttft": None, "tpot": None, "e2e": 0.5, "tokens": 0,
                                                  "error": "APIError: boom", "valid": False}]
    s = summarize(results, wall=4.0, cut=0)
    assert (s["requests"], s["errors"], s["valid"]) == (5, 1, 2)
    assert s["ttft"] == {"p50": 3.0, "p99": 4.0}  # nearest rank over the 4 answered requests
    assert s["output_tok_s"] == 10.0 and s["first_error"] == "APIError: boom"
    # Cut at the cell's timeout: the finished requests' figures stay, the rate is none (the wall is the timeout's).
    s = summarize(results, wall=4.0, cut=3)
    assert (s["requests"], s["cut"], s["ttft"]["p50"], s["output_tok_s"]) == (5, 3, 3.0, None)


def test_a_cell_cut_at_its_timeout_keeps_the_requests_that_finished(monkeypatch):
    import asyncio

    from bench import serve

    async def one_request(client, model, req, max_tokens):
        await asyncio.sleep(req["delay"])
        return {"ttft": 0.01, "tpot": 0.001, "e2e": req["delay"], "tokens": 5, "error": None, "valid": True}

    class Models:
        async def list(self):
            return type("L", (), {"data": [type("M", (), {"id": "m"})()]})()

    class Client:
        def __init__(self, **kwargs):
            self.models = Models()

        async def close(self):
            pass

    import openai
    monkeypatch.setattr(openai, "AsyncOpenAI", Client)
    monkeypatch.setattr(serve, "one_request", one_request)
    cell = asyncio.run(serve.run_cell("http://x", [{"delay": 0.0}, {"delay": 0.05}, {"delay": 30.0}], 3, 8, 1.0))
    assert (cell["requests"], cell["cut"], cell["valid"], cell["output_tok_s"]) == (2, 1, 2, None)
    assert "1 cut at the cell timeout" in serve.row_line(dict(cell, config="none", workload="json", concurrency=3))


def test_cli_end_to_end(tiny_model_dir, tmp_path, capsys):
    result_file = tmp_path / "serve.jsonl"
    record = main(["--model-path", str(tiny_model_dir), "--configs", "none", "NGRAM", "--concurrency", "1", "2",
                   "--num-requests", "2", "--max-tokens", "12", "--dtype", "float32",
                   "--result-file", str(result_file)])
    out = capsys.readouterr().out
    cells = {(c["config"], c["workload"], c["concurrency"]): c for c in record["cells"]}
    assert set(cells) == {(cfg, w, c) for cfg in ("none", "NGRAM") for w in ("json", "tools") for c in (1, 2)}
    for cell in cells.values():
        assert cell["requests"] == 2 and cell["errors"] == 0 and not cell["cut"], cell
        assert cell["output_tok_s"] > 0
        # TTFT is the first content or tool-call delta: the random model's parallel calls, which go out only whole,
        # may be cut by max_tokens before one completes, and then the reply sends none, so it cannot be valid.
        assert cell["ttft"]["p50"] is not None or (cell["workload"] == "tools" and cell["valid"] == 0)
    rows = re.findall(r"^(none|NGRAM)\s+(json|tools)\s+(\d+)\s+2\s+\d/2\s+0\s", out, re.M)
    assert len(rows) == 8, out
    assert "speed-up NGRAM/none json conc 1:" in out
    for cell in cells.values():  # every workload ends with the KV invariant checked in the server
        kv = cell["kv_after"]  # idle: every slot is free or held by the prefix cache
        assert kv["ok"] and kv["kv_free"] + kv["kv_cached"] == kv["kv_pool_size"]
    assert out.count("KV after") == 2 and "LEAK" not in out
    assert json.loads(result_file.read_text())["cells"][0]["config"] == "none"


def test_agent_workload_shares_a_long_system_prompt(default_model_dir):
    """The agent workload: every request behind the same ~1,000-token system prompt (what the
    prefix cache is measured on), then the tools workload's own user turn."""
    from transformers import AutoTokenizer

    tokens = len(AutoTokenizer.from_pretrained(default_model_dir)(agent_system_prompt())["input_ids"])
    assert 900 <= tokens <= 1300, tokens
    requests = tool_requests(parse_args(["--num-requests", "3"]), agent_system_prompt())
    assert [r["messages"][0] for r in requests] == [{"role": "system", "content": agent_system_prompt()}] * 3
    assert len({r["messages"][1]["content"] for r in requests}) == 3
