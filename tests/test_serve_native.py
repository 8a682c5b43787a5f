"""specjet serve's SGLang-native endpoints (POST /generate and the rest), a real server in a subprocess over the
tiny random model, driven over HTTP as SGLang's clients do. Oracles: the OpenAI completions endpoint's greedy
output for the same prompt (one engine, batch-invariant kernels), the non-streamed answer for a stream,
jsonschema for a schema's output, the KV invariant after the module's workloads."""
from __future__ import annotations

import json
import threading
import time

import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from test_serve import PERSON, Server, kv_ok

GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = Server(["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096"])
    yield srv
    try:
        kv_ok(srv)
    finally:
        srv.stop()


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kwargs)


def events(response: httpx.Response) -> list:
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def completions_text(server, prompt: str, max_tokens: int) -> str:
    r = post(server, "/v1/completions", {"model": "m", "prompt": prompt, "temperature": 0, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_generate_gives_the_engines_output_as_sglang_lays_it_out(server):
    # The body SGLang's bench_serving (--backend sglang) posts, its unsupported features at their defaults.
    r = post(server, "/generate", {"text": "The capital of", "sampling_params": GREEDY, "stream": False,
                                   "lora_path": None, "return_logprob": False, "return_routed_experts": False,
                                   "logprob_start_len": -1})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) >= {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 24 == len(out["output_ids"])
    assert out["text"] == completions_text(server, "The capital of", 24)  # the same engine's greedy output


def test_a_list_of_prompts_gives_a_list_each_as_alone(server):
    prompts = ["one two", "alpha beta gamma"]
    alone = [post(server, "/generate", {"text": p, "sampling_params": GREEDY}).json() for p in prompts]
    r = post(server, "/generate", {"text": prompts, "sampling_params": [GREEDY, dict(GREEDY, max_new_tokens=10)]})
    assert r.status_code == 200, r.text
    both = r.json()
    assert isinstance(both, list) and len(both) == 2
    assert both[0]["output_ids"] == alone[0]["output_ids"]
    assert both[1]["output_ids"] == alone[1]["output_ids"][:10]


def test_input_ids_and_logprobs(server):
    text_out = post(server, "/generate", {"text": "hello there", "sampling_params": GREEDY}).json()
    ids = post(server, "/generate", {"input_ids": [100, 200, 300], "sampling_params": GREEDY,
                                     "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}).json()
    meta = ids["meta_info"]
    assert meta["prompt_tokens"] == 3 and len(meta["output_token_logprobs"]) == len(ids["output_ids"]) == 24
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids["output_ids"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert [t for _, t, _ in meta["input_token_logprobs"]] == [100, 200, 300]
    assert text_out["meta_info"]["prompt_tokens"] > 0


def test_a_stream_sends_the_output_so_far_and_ends_as_the_whole_answer(server):
    whole = post(server, "/generate", {"text": "Once upon a time", "sampling_params": GREEDY,
                                       "return_logprob": True}).json()
    r = post(server, "/generate", {"text": "Once upon a time", "sampling_params": GREEDY, "stream": True,
                                   "return_logprob": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    got = events(r)
    assert len(got) >= 2
    for earlier, later in zip(got, got[1:]):  # each event extends the one before (SGLang's default)
        assert later["text"].startswith(earlier["text"])
        assert later["output_ids"][:len(earlier["output_ids"])] == earlier["output_ids"]
    last = got[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in got[:-1])


def test_a_streamed_list_carries_each_requests_index(server):
    prompts = ["red green", "north south east"]
    alone = [post(server, "/generate", {"text": p, "sampling_params": GREEDY}).json() for p in prompts]
    got = events(post(server, "/generate", {"text": prompts, "sampling_params": GREEDY, "stream": True}))
    last = {}
    for event in got:
        last[event["index"]] = event
    assert [last[i]["output_ids"] for i in (0, 1)] == [a["output_ids"] for a in alone]


def test_a_json_schema_in_the_sampling_params_is_enforced(server):
    r = post(server, "/generate", {"text": "A person:", "sampling_params": {
        "temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(PERSON)}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
    jsonschema.validate(json.loads(out["text"]), PERSON)


@pytest.mark.parametrize("body,param,words", [
    ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature", "temperature"),
    ({"text": "x", "sampling_params": {"regex": "(yes|no"}}, "regex", "parenthesis is not closed"),
    ({"text": "x", "input_ids": [1, 2]}, "text", "exactly one of text and input_ids"),
    ({"text": "x", "lora_path": "adapter"}, "lora_path", "lora_path='adapter' is not supported"),
    ({"text": "x", "frobnicate": 1}, None, "frobnicate"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 3, "foo": 1}}, "foo", "unknown sampling parameter(s): foo"),
    ({"text": "x", "stream": 1}, None, "stream"),
    ({"text": ["a", "b"], "return_logprob": True, "logprob_start_len": [0]}, "logprob_start_len",
     "1 logprob_start_len values for 2"),
    ({"text": ["a", "b"], "return_logprob": True, "logprob_start_len": [0, 0], "sampling_params": [GREEDY] * 3},
     "sampling_params", "3 sampling_params for 2 prompts"),
    ({"text": ["a", "b"], "sampling_params": [GREEDY] * 3}, None, "3 sampling_params for 2 prompts"),
    ({"text": "x", "sampling_params": {"n": 0}}, "n", "n must be an integer in [1, 128]"),
    ({"text": "x", "sampling_params": {"n": True}}, "n", "n must be an integer"),
    ({"text": "x", "sampling_params": {"n": 129}}, "n", "n must be an integer in [1, 128]"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 3}]}, "n", "the same in every sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 2}, {}]}, "n", "the same in every sampling_params"),
    ({"text": ["a", "b"], "sampling_params": {"n": 2}, "rid": ["r"]}, "rid", "1 rids for 2 prompts"),
    ({"text": ["a", "b"], "sampling_params": {"n": 2}, "return_logprob": [True, True]}, "return_logprob",
     "cannot go with n > 1"),
    ({"text": "x", "sampling_params": {"spaces_between_special_tokens": False}}, "spaces_between_special_tokens",
     "spaces_between_special_tokens=False"),
    ({"text": "x", "sampling_params": {"stop_regex": ["a+"]}}, "stop_regex", "stop_regex=['a+']"),
    ({"text": "x", "return_hidden_states": True}, "return_hidden_states", "return_hidden_states=True"),
    ({"text": "x", "priority": 3}, "priority", "priority=3"),
    ({"text": "x", "sampling_params": {"seed": 1, "sampling_seed": 2}}, "sampling_seed", "not both"),
    ({"text": "x", "sampling_params": {"min_new_tokens": -1}}, None, "min_new_tokens must be >= 0"),
])
def test_what_the_door_refuses_is_a_400_naming_it(server, body, param, words):
    r = post(server, "/generate", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] or words in json.dumps(error), error
    if param is not None:
        assert error["param"] == param, error


def test_the_bodies_sglangs_own_tests_send(server):
    """As SGLang: the logprob fields are ignored without return_logprob, stream_options is ignored, and SGLang's
    sampling parameters for features specjet lacks pass at their defaults."""
    plain = post(server, "/generate", {"text": "The sky is", "sampling_params": GREEDY}).json()
    for body in ({"return_logprob": False, "logprob_start_len": 0, "top_logprobs_num": 3},
                 {"stream_options": {"include_usage": True}},
                 {"sampling_params": dict(GREEDY, n=1, min_new_tokens=0, no_stop_trim=False,
                                          spaces_between_special_tokens=True)},
                 # SGLang's frontend (sgl.gen's to_srt_kwargs): its defaults, nulls among them
                 {"sampling_params": dict(GREEDY, stop_regex=[], json_schema=None, regex=None, stop=None,
                                          structural_tag=None, sampling_seed=None)},
                 # fields a router adds, or clients send at SGLang's defaults
                 {"model": "anything", "data_parallel_rank": None, "return_hidden_states": False,
                  "custom_logit_processor": None, "session_params": None, "modalities": None, "lora_id": None,
                  "priority": None, "log_metrics": True, "custom_labels": {"team": "a"}}):
        r = post(server, "/generate", {"text": "The sky is", "sampling_params": GREEDY, **body})
        assert r.status_code == 200, (body, r.text)
        assert r.json()["output_ids"] == plain["output_ids"] and "output_token_logprobs" not in r.json()["meta_info"]


def metric(server, name: str) -> float:
    """A sample of the server's /metrics (``name`` with its labels, as Prometheus writes it); 0 when absent."""
    for line in httpx.get(server.url + "/metrics", timeout=60).text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.split()[-1])
    return 0.0


def test_abort_request_ends_a_non_streamed_request_with_its_finish_reason(server):
    """SGLang answers an aborted request with its output and finish_reason (200), not an error."""
    aborted_before = metric(server, 'specjet_requests_total{finish_reason="aborted"}')
    body = {"text": "count:", "rid": "native-ns-abort",
            "sampling_params": {"temperature": 0, "max_new_tokens": None, "ignore_eos": True}}
    answer: list = []
    worker = threading.Thread(target=lambda: answer.append(post(server, "/generate", body)))
    worker.start()
    deadline = time.monotonic() + 60
    while metric(server, "specjet_num_running_reqs") < 1:  # until it runs (its rid is then live), then abort it
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    assert post(server, "/abort_request", {"rid": "native-ns-abort"}).status_code == 200
    worker.join(120)
    r = answer[0]
    assert r.status_code == 200, r.text
    reason = r.json()["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["err_type"] == "request_aborted" and reason["status_code"] == 400
    assert len(r.json()["output_ids"]) < 3000
    assert metric(server, 'specjet_requests_total{finish_reason="aborted"}') == aborted_before + 1


def test_abort_all_ends_every_running_stream(server):
    body = {"text": ["one:", "two:"], "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": None, "ignore_eos": True}}
    last: dict = {}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[len("data: "):])
                if not last:
                    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
                last[event["index"]] = event
    for event in last.values():
        assert event["meta_info"]["finish_reason"]["err_type"] == "request_aborted", event["meta_info"]
    assert set(last) == {0, 1}
    r = post(server, "/abort_request", {})
    assert r.status_code == 400 and "abort_all" in r.json()["error"]["message"]


def test_a_client_that_leaves_a_native_stream_aborts_its_request(server):
    gone = metric(server, 'specjet_requests_total{finish_reason="client_disconnected"}')
    body = {"text": "count:", "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": None,
                                                                  "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while metric(server, 'specjet_requests_total{finish_reason="client_disconnected"}') < gone + 1:
        assert time.monotonic() < deadline, "the server did not notice the client leave"
        time.sleep(0.1)
    assert metric(server, 'specjet_requests_total{finish_reason="client_disconnected"}') == gone + 1
    assert metric(server, "specjet_num_running_reqs") == 0  # aborted, not running on to its 3,000 tokens
    assert kv_ok(server)["ok"]  # its KV is back (idle: free or cached)


def test_abort_request_ends_a_running_stream(server):
    """SGLang's POST /abort_request by rid: the stream's last event is the abort, with its kind."""
    body = {"text": "count:", "rid": "native-abort-me", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": None, "ignore_eos": True}}
    got: list = []
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got.append(json.loads(line[len("data: "):]))
                if len(got) == 2:
                    threading.Thread(target=post, args=(server, "/abort_request", {"rid": "native-abort-me"})).start()
    reason = got[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["err_type"] == "request_aborted", reason
    assert len(got[-1]["output_ids"]) < 3000


def test_the_info_and_cache_endpoints(server, tiny_model_dir):
    info = httpx.get(server.url + "/get_model_info", timeout=30).json()
    assert info == {"model_path": str(tiny_model_dir), "tokenizer_path": str(tiny_model_dir), "is_generation": True}
    assert httpx.get(server.url + "/model_info", timeout=30).json() == info  # SGLang's later names too
    assert httpx.get(server.url + "/server_info", timeout=60).json()["internal_states"]
    post(server, "/generate", {"text": "a prefix worth caching " * 4, "sampling_params": GREEDY})
    post(server, "/generate", {"text": "A person:", "sampling_params": {  # a grammar: it drafts (guided drafting)
        "temperature": 0, "max_new_tokens": 16, "json_schema": json.dumps(PERSON)}})
    server_info = httpx.get(server.url + "/get_server_info", timeout=60).json()
    assert server_info["model_path"] == str(tiny_model_dir) and server_info["alive"] is True
    # SGLang's clients read internal_states[0]: the engine's accept length (the schema request drafted).
    assert server_info["internal_states"] == [{"avg_spec_accept_length": server_info["stats"]["spec_accept_length"]}]
    assert server_info["internal_states"][0]["avg_spec_accept_length"] >= 1
    assert server_info["kv_pool_size"] >= 4096 and server_info["stats"]["requests_submitted"] >= 1
    flushed = post(server, "/flush_cache", {}).json()
    assert isinstance(flushed["flushed_tokens"], int) and flushed["flushed_tokens"] > 0
    assert httpx.get(server.url + "/flush_cache", timeout=60).json()["flushed_tokens"] == 0  # nothing left


def test_health_generate_runs_a_token_through_an_idle_engine(server):
    """SGLang's /health_generate: on an idle engine it answers 200 only after a probe request went through (one more
    request submitted), and leaves nothing running (the module's KV invariant)."""
    def submitted() -> int:
        return httpx.get(server.url + "/get_server_info", timeout=60).json()["stats"]["requests_submitted"]

    before = submitted()
    r = httpx.get(server.url + "/health_generate", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert submitted() == before + 1
    running = httpx.get(server.url + "/metrics", timeout=60).text
    assert "specjet_num_running_reqs 0" in running


def test_parallel_sampling_n(server):
    """SGLang's n > 1: each prompt's n samples, prompt-major, a list even for one prompt; with a seed sample i is
    the single request seeded seed + i (so the samples differ, and the same request gives the same ones), rid r
    becomes r_0, r_1, ...; streamed, the same outputs under their indices; nothing left running."""
    sp = {"temperature": 1.0, "max_new_tokens": 12, "seed": 7}
    singles = [[post(server, "/generate", {"text": p, "sampling_params": dict(sp, seed=7 + j)}).json()["text"]
                for j in range(3)] for p in ("Once upon a time", "The sky is")]
    assert len(set(singles[0])) > 1  # the seeds differ, so do the samples (a random model at temperature 1)
    prompt_before, generated_before = metric(server, "specjet_prompt_tokens_total"), metric(
        server, "specjet_generation_tokens_total")
    one = post(server, "/generate", {"text": "Once upon a time", "sampling_params": dict(sp, n=3), "rid": "job"})
    assert one.status_code == 200, one.text
    # The metrics count the prompt once, and every sample's tokens.
    assert metric(server, "specjet_prompt_tokens_total") - prompt_before == one.json()[0]["meta_info"]["prompt_tokens"]
    assert metric(server, "specjet_generation_tokens_total") - generated_before == sum(
        o["meta_info"]["completion_tokens"] for o in one.json())
    assert [o["text"] for o in one.json()] == singles[0]
    assert [o["meta_info"]["id"] for o in one.json()] == ["job_0", "job_1", "job_2"]
    both = post(server, "/generate", {"text": ["Once upon a time", "The sky is"],
                                      "sampling_params": [dict(sp, n=3), dict(sp, n=3)]}).json()
    assert [o["text"] for o in both] == singles[0] + singles[1]
    streamed: dict[int, str] = {}
    r = post(server, "/generate", {"text": ["Once upon a time", "The sky is"], "sampling_params": dict(sp, n=3),
                                   "stream": True})
    for event in events(r):
        streamed[event["index"]] = event["text"]  # whole so far: the last event of an index is its output
    assert [streamed[i] for i in range(6)] == singles[0] + singles[1]
    assert post(server, "/generate", {"text": "x", "sampling_params": {"n": 1, "max_new_tokens": 2}}).status_code == 200
    # SGLang's sampling_seed is the seed each sample offsets; a null seed is none; a seed the engine refuses is
    # refused with n > 1 as with one sample.
    renamed = post(server, "/generate", {"text": "Once upon a time", "sampling_params": dict(
        {k: v for k, v in sp.items() if k != "seed"}, sampling_seed=7, n=3)}).json()
    assert [o["text"] for o in renamed] == singles[0]
    assert post(server, "/generate", {"text": "x", "sampling_params": dict(sp, seed=None, n=2)}).status_code == 200
    for bad in (-1, True, 2**64):
        r = post(server, "/generate", {"text": "x", "sampling_params": dict(sp, seed=bad, n=2)})
        assert r.status_code == 400 and "seed" in r.json()["error"]["message"], (bad, r.text)
    kv_ok(server)


def test_min_new_tokens_and_openais_min_tokens(server):
    """SGLang's min_new_tokens on /generate, and the OpenAI endpoints' min_tokens (SGLang's and vLLM's extra): a
    stop token the output reaches at once is held until the output has that many tokens."""
    ids = post(server, "/generate", {"text": "The sky is", "sampling_params": GREEDY}).json()["output_ids"]
    stop = ids[1]
    early = post(server, "/generate", {"text": "The sky is", "sampling_params": dict(GREEDY, stop_token_ids=[stop])})
    assert early.json()["output_ids"] == ids[:2]
    held = post(server, "/generate", {"text": "The sky is", "sampling_params": dict(
        GREEDY, stop_token_ids=[stop], min_new_tokens=6)}).json()["output_ids"]
    assert stop not in held[:6] and len(held) >= 7
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": "The sky is", "temperature": 0, "max_tokens": 24, "stop_token_ids": [stop], "min_tokens": 6})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == len(held)
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "min_tokens": 2,
        "response_format": {"type": "json_object"}})
    assert bad.status_code == 400 and "min_tokens cannot go with" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "min_tokens"  # as the client named it, message too
    kv_ok(server)


def test_sglang_names_and_batches(server, tiny_model_dir):
    """SGLang's sampling_seed is the seed; a string rid with a list of prompts names them rid_0, rid_1, ...;
    return_text_in_logprobs fills each logprob triple's text with its token's (whole and streamed)."""
    sampled = {"temperature": 1.0, "max_new_tokens": 8}
    seeded = post(server, "/generate", {"text": "Once", "sampling_params": dict(sampled, seed=5)}).json()
    renamed = post(server, "/generate", {"text": "Once", "sampling_params": dict(sampled, sampling_seed=5)}).json()
    assert renamed["output_ids"] == seeded["output_ids"]
    both = post(server, "/generate", {"text": ["Hi", "Yo"], "rid": "batch7", "sampling_params": GREEDY})
    assert both.status_code == 200, both.text
    assert [o["meta_info"]["id"] for o in both.json()] == ["batch7_0", "batch7_1"]
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    body = {"text": "Once upon", "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "return_text_in_logprobs": True}
    out = post(server, "/generate", body).json()["meta_info"]
    for name in ("input_token_logprobs", "output_token_logprobs"):
        assert out[name] and all(text == tokenizer.decode([tid]) for _, tid, text in out[name]), name
    assert all(text == tokenizer.decode([tid]) for top in out["output_top_logprobs"] for _, tid, text in top)
    last = events(post(server, "/generate", dict(body, stream=True)))[-1]["meta_info"]
    assert last["output_token_logprobs"] == out["output_token_logprobs"]
    plain = post(server, "/generate", dict(body, return_text_in_logprobs=False)).json()["meta_info"]
    assert all(text is None for _, _, text in plain["output_token_logprobs"])


def test_get_load(server):
    load = httpx.get(server.url + "/get_load", timeout=60).json()
    assert isinstance(load, list) and len(load) == 1
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pages"}
    assert all(isinstance(v, int) and v >= 0 for v in load[0].values())
