"""The overlap loop (the default on CUDA; asked for by name here) gives exactly the plain loop's outputs (the
CPU's default), and the compute stream runs work in order and hands exceptions back. Tiny random-weight
model; every workload ends with the KV invariant."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import specjet
from specjet.scheduler.streams import CpuStream, make_stream

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "JSON is",
    "A much longer prompt that goes on for a while so that the batch has requests of quite different lengths",
    "a b c a b c a b c a b",
]
SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}'


def mixed_params(stop_text: str | None = None) -> list[dict]:
    """Plain text, JSON schema, regex; requests that finish early (short max_new_tokens, a stop
    string) beside long ones."""
    base = {"temperature": 0, "ignore_eos": True}
    params = [
        dict(base, max_new_tokens=40),
        dict(base, max_new_tokens=30, json_schema=SCHEMA),
        dict(base, max_new_tokens=3),
        dict(base, max_new_tokens=25, regex=r"(yes|no), [0-9]{2,4}"),
        dict(base, max_new_tokens=33),
        dict(base, max_new_tokens=1),
    ]
    if stop_text:
        params[4]["stop"] = [stop_text]
    return params


def run_workload(engine) -> list[list[int]]:
    outs = engine.generate(PROMPTS, mixed_params(stop_text=" the"))
    singles = [engine.generate(p, sp) for p, sp in zip(PROMPTS[:3], mixed_params()[:3])]
    engine.wait_idle()
    engine.check_kv_invariant()
    return [o["output_ids"] for o in outs + singles]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096,
                        disable_overlap_schedule=True, disable_guided_drafting=True) as eng:
        yield run_workload(eng)


@pytest.mark.parametrize("kwargs", [
    {},
    {"page_size": 16},
    {"speculative_algorithm": "NGRAM"},
    {"speculative_algorithm": "NGRAM", "disable_overlap_schedule": True, "page_size": 16},
])
def test_overlap_matches_the_plain_loop(tiny_model_dir, reference, kwargs):
    kwargs = dict({"max_total_tokens": 4096, "disable_overlap_schedule": False}, **kwargs)
    with specjet.Engine(model_path=str(tiny_model_dir), **kwargs) as eng:
        assert run_workload(eng) == reference
        overlap = eng.get_server_info()["stats"]["overlap"]
    assert overlap["iterations"] > 0 and overlap["compute_ms_median"] > 0
    if "speculative_algorithm" not in kwargs:  # plain decoding: the forward is part of the iteration
        assert 0 < overlap["forward_ms_median"] <= overlap["iteration_ms_median"]
    else:
        assert "forward_ms_median" not in overlap


def test_iteration_timings_stay_with_their_batches_after_an_idle_release(tiny_model_dir):
    """The idle loop's hand-over of ended requests runs on the compute stream between batches; it must not
    shift the stream's timings onto the next batches (each plain decode batch is its forward, then its
    sampling). Each decode forward is made 20 ms slower, so every decode record's forward is at least that,
    and the median iteration holds it; a record that took the previous batch's sampling for its forward
    fails it."""
    slow_s = 0.02
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_overlap_schedule=False) as eng:
        assert eng.get_server_info()["overlap_schedule"] is True
        real_forward, real_release, released = eng.worker.forward, eng.worker.release, []

        def forward(batch):
            if batch.kind.value == "decode":
                time.sleep(slow_s)
            return real_forward(batch)

        def release(rids):
            released.extend(rids)
            return real_release(rids)

        eng.worker.forward, eng.worker.release = forward, release
        greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}
        eng.generate(PROMPTS[0], greedy, rid="first")
        deadline = time.monotonic() + 10
        while "first" not in released:  # the loop went idle and handed the ended request over
            assert time.monotonic() < deadline, "the idle loop did not hand the ended request over"
            time.sleep(0.01)
        eng.generate(PROMPTS[1], dict(greedy, max_new_tokens=12))
        eng.wait_idle()
        records = eng.scheduler.run_in_loop(lambda: list(eng.loop._iteration_records)).result()
        overlap = eng.get_server_info()["stats"]["overlap"]
        eng.check_kv_invariant()
    decodes = [r for r in records if r["kind"] == "decode"]
    assert len(decodes) >= 12
    assert all(r["forward_s"] >= slow_s for r in decodes), sorted(r["forward_s"] for r in decodes)
    assert all(r["forward_s"] <= r["compute_s"] for r in decodes)
    assert slow_s * 1e3 <= overlap["forward_ms_median"] <= overlap["iteration_ms_median"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_stream_work_sees_the_hosts_earlier_device_writes():
    """The scheduler writes the slot table (a cached prefix, a decode step's next slot) on its own thread's
    stream, and the overlap loop's forwards read it on the compute stream: an item must see every device
    write the host launched before submitting it. The host's write is held back on its stream behind a
    spin kernel (~25 ms); a compute stream that does not wait for it reads the zeros."""
    stream = make_stream(torch.device("cuda"), overlap=True)
    values = torch.arange(1 << 16, device="cuda")
    for _ in range(3):
        table = torch.zeros_like(values)
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        table.copy_(values)
        seen = stream.submit(lambda: table.clone()).result()
        torch.cuda.synchronize()
        assert torch.equal(seen, values)


def test_untimed_stream_items_leave_no_timing():
    """Housekeeping submitted with timed=False (and synchronize's marker) runs in order but is not timed."""
    stream = CpuStream()
    try:
        order = []
        stream.submit(order.append, 1)
        stream.submit(order.append, 2, timed=False)
        stream.submit(order.append, 3)
        stream.synchronize()
        assert order == [1, 2, 3]
        assert len(stream.take_timings()) == 2
    finally:
        stream.close()
    inline = make_stream(torch.device("cpu"), overlap=False)
    inline.submit(lambda: None, timed=False).result()
    inline.submit(lambda: None).result()
    assert len(inline.take_timings()) == 1


def test_the_default_loop_is_the_plain_one_on_the_cpu_and_the_overlap_one_on_cuda(tiny_model_dir):
    from specjet.engine.loading import use_overlap_schedule

    assert use_overlap_schedule(None, torch.device("cpu")) is False
    assert use_overlap_schedule(None, torch.device("cuda")) is True
    assert use_overlap_schedule(False, torch.device("cpu")) is True
    assert use_overlap_schedule(True, torch.device("cuda")) is False
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, device="cpu") as eng:
        assert eng.get_server_info()["overlap_schedule"] is False
        assert not eng.loop.overlap and eng.loop.stream.__class__.__name__ == "InlineStream"
        eng.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 4})
        eng.check_kv_invariant()


def test_retraction_under_kv_pressure_matches(tiny_model_dir):
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    outs = {}
    for overlap in (False, True):
        with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=160, page_size=16,
                            disable_overlap_schedule=not overlap) as eng:
            outs[overlap] = [o["output_ids"] for o in eng.generate(PROMPTS * 2, params)]
            eng.check_kv_invariant()
            assert eng.get_server_info()["stats"]["retractions"] > 0
    assert outs[True] == outs[False]


def test_abort_mid_flight_leaves_the_rest_intact(tiny_model_dir, reference):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_overlap_schedule=False) as eng:
        victim = eng.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True},
                              stream=True)
        first = next(victim)
        results = {}
        worker = threading.Thread(target=lambda: results.update(out=eng.generate(PROMPTS, mixed_params(" the"))))
        worker.start()
        time.sleep(0.05)  # the batch is running with the victim in it
        eng.abort_request(first["meta_info"]["id"])
        chunks = [first, *victim]
        worker.join(timeout=120)
        eng.wait_idle()
        eng.check_kv_invariant()
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert [o["output_ids"] for o in results["out"]] == reference[:len(PROMPTS)]


def test_invalid_schema_fails_alone_under_overlap(tiny_model_dir, reference):
    params = mixed_params(" the")
    # valid JSON that the grammar compiler refuses (a dangling $ref), past the door's wait for the compile (0 here,
    # as for a compile slower than the wait): it fails its request alone
    params[2] = dict(params[2], json_schema={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_overlap_schedule=False) as eng:
        eng.scheduler.grammar_backend.door_compile_wait_s = 0.0
        outs = eng.generate(PROMPTS, params)
        eng.check_kv_invariant()
    assert outs[2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert "json_schema" in outs[2]["meta_info"]["finish_reason"]["message"]
    others = [o["output_ids"] for i, o in enumerate(outs) if i != 2]
    assert others == [ids for i, ids in enumerate(reference[:len(PROMPTS)]) if i != 2]


def test_cpu_stream_runs_in_submission_order_on_its_own_thread():
    stream = CpuStream()
    seen = []
    try:
        def work(i):
            time.sleep(0.002 * (5 - i))  # earlier items take longer: order must still hold
            seen.append((i, threading.current_thread().name))
            return i * i

        futures = [stream.submit(work, i) for i in range(5)]
        assert [f.result(timeout=10) for f in futures] == [0, 1, 4, 9, 16]
        assert [i for i, _ in seen] == list(range(5))
        assert {name for _, name in seen} == {"specjet-compute"}
        timings = stream.take_timings()
        assert len(timings) == 5
        assert all(t.submitted <= t.started <= t.ended for t in timings)
        assert all(a.ended <= b.started for a, b in zip(timings, timings[1:]))
    finally:
        stream.close()


def test_cpu_stream_propagates_exceptions_and_keeps_running():
    stream = CpuStream()
    try:
        def boom():
            raise ValueError("broken work")

        failed = stream.submit(boom)
        after = stream.submit(lambda: "still here")
        with pytest.raises(ValueError, match="broken work"):
            failed.result(timeout=10)
        assert after.result(timeout=10) == "still here"
    finally:
        stream.close()


@pytest.mark.parametrize("algorithm", [None, "NGRAM"])
def test_a_rid_reused_at_once_keeps_its_compute_state(tiny_model_dir, algorithm):
    """A finished request's rid is free at once, while batches launched with the request may still be in flight:
    its compute state used to be handed over for dropping only once those were processed, by which time a new
    request of the same rid had started its own, which the drop then took (its next batch failed, and every
    request of that batch was re-run). Now the hand-over comes first; no batch fails, every output is its own."""
    kwargs = {} if algorithm is None else {"speculative_algorithm": algorithm}
    short = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_overlap_schedule=False,
                        **kwargs) as eng:
        expected = eng.generate(PROMPTS[3], short)["output_ids"]
        background = [eng.generate(p, {"temperature": 0, "max_new_tokens": None, "ignore_eos": True}, stream=True)
                      for p in PROMPTS[:2]]  # batches keep going beside the reused rid
        for stream in background:
            next(stream)
        outs = [eng.generate(PROMPTS[3], short, rid="again")["output_ids"] for _ in range(30)]
        for stream in background:
            stream.close()
        eng.wait_idle()
        stats = eng.get_server_info()["stats"]
        eng.check_kv_invariant()
    assert outs == [expected] * 30
    assert stats["batch_failures"] == 0 and stats["requests_isolated"] == 0


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("cache", [False, True])
def test_a_chunked_prompt_is_retracted_before_a_running_request_is_refused(tiny_model_dir, overlap, cache):
    """A long prompt prefilled in chunks holds its whole prompt's KV while the running request grows between its
    chunks; when that request needed a slot the pool no longer had, it was refused ("KV pool exhausted: the request
    needs more than the pool's slots", which it did not: alone it finishes in this pool) and the newer prompt went
    on. The chunked prompt is now retracted first and waits; both finish, the first with its own output."""
    a_prompt, b_prompt = list(range(100, 120)), list(range(200, 800))  # 20 and 600 tokens, a 1,024-slot pool
    params = {"temperature": 0, "max_new_tokens": 700, "ignore_eos": True}
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=1024, chunked_prefill_size=8,
                        disable_radix_cache=not cache, disable_overlap_schedule=not overlap) as eng:
        alone = eng.generate(input_ids=a_prompt, sampling_params=params)["output_ids"]
        stream = eng.generate(input_ids=a_prompt, sampling_params=params, stream=True)
        got, late = [], {}
        for chunk in stream:
            got += chunk["output_ids"]
            if not late and len(a_prompt) + len(got) >= 395:  # B fits beside A now, not beside A's next 300 tokens
                worker = threading.Thread(target=lambda: late.update(out=eng.generate(
                    input_ids=b_prompt, sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})))
                late["thread"] = worker
                worker.start()
            last = chunk
        late["thread"].join(timeout=120)
        eng.wait_idle()
        retractions = eng.get_server_info()["stats"]["retractions"]
        eng.check_kv_invariant()
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 700} and got == alone
    assert late["out"]["meta_info"]["finish_reason"]["type"] == "length"
    assert retractions >= 1  # the chunked prompt went back to wait
