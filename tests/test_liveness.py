"""No caller waits for ever and no abandoned request holds KV: async callers cancelled by
``fail_after`` / ``move_on_after``, ``async for`` loops left early, stream iterators dropped
unread; a scheduler thread that dies answers everyone (and later calls raise at once); 16 threads
mixing plain, grammar, speculative and streaming requests through ``shutdown()``."""
from __future__ import annotations

import concurrent.futures
import gc
import threading
import time

import anyio
import pytest

import specjet
from robustness_helpers import assert_healthy, bounded

LONG = {"temperature": 0, "max_new_tokens": 1500, "ignore_eos": True}
SHORT = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, random_seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def long_s(engine) -> float:
    """How long LONG takes whole on this machine: the cuts below come a quarter of the way in, however fast the
    engine gets (a fixed 0.3 s once outlasted the whole request)."""
    start = time.perf_counter()
    engine.generate("a long one", LONG)
    return time.perf_counter() - start


def assert_released(engine):
    """Every abandoned request was aborted: the engine drains (LONG would run for seconds) and
    free + owned KV == the pool, with nothing owned by a request (only by the prefix cache)."""
    assert_healthy(engine)
    info = engine.get_server_info()
    assert info["kv_free"] + info["radix_cache"]["cached_tokens"] == info["kv_pool_size"]


def test_async_fail_after_aborts_the_request(engine, long_s):
    async def main():
        with pytest.raises(TimeoutError):
            with anyio.fail_after(long_s / 4):
                await engine.async_generate("a long one", LONG)
    anyio.run(main)
    assert_released(engine)


def test_async_stream_cut_by_move_on_after_aborts(engine, long_s):
    async def main():
        stream = await engine.async_generate("a long one", LONG, stream=True)
        got = [await stream.__anext__()]  # mid-stream, however slow the machine is to the first chunk
        with anyio.move_on_after(long_s / 4):
            async for chunk in stream:
                got.append(chunk)
        return got
    got = anyio.run(main)
    assert got and got[-1]["meta_info"]["finish_reason"] is None  # cut, not finished
    assert_released(engine)


@pytest.mark.parametrize("cut_after_s", [0.0, 0.001])
def test_an_async_stream_cut_before_its_first_chunk_leaves_later_callers_served(engine, cut_after_s):
    """The abort's output for a loop that has ended must not hold the thread that serves every
    async caller (it once waited for ever on the ended loop, and the next stream never got a chunk)."""
    async def cut():
        with anyio.move_on_after(cut_after_s):
            async for _ in await engine.async_generate("a long one", LONG, stream=True):
                pass

    async def later():
        async for chunk in await engine.async_generate(["one", "two"], SHORT, stream=True):
            return chunk

    for _ in range(3):
        anyio.run(cut)
        assert bounded(anyio.run, later, timeout=30)["output_ids"]
    assert_released(engine)


def test_breaking_out_of_async_for_aborts(engine):
    async def main():
        async for chunk in await engine.async_generate(["one", "two"], LONG, stream=True):
            return chunk
    assert anyio.run(main)["output_ids"]
    gc.collect()
    assert_released(engine)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stream_dropped_unread_aborts(engine, kind):
    if kind == "sync":
        stream = engine.generate("a long one", LONG, stream=True)
    else:
        async def start():
            return await engine.async_generate("a long one", LONG, stream=True)
        stream = anyio.run(start)
    del stream
    gc.collect()
    assert_released(engine)


def test_breaking_out_of_a_sync_stream_aborts(engine):
    for chunk in engine.generate("a long one", LONG, stream=True):
        break
    gc.collect()
    assert_released(engine)


def break_the_loop(sched, answers: bool) -> None:
    """Make the scheduler's loop fail for good (its last-resort handler too); unless ``answers``, the
    thread cannot even answer the requests it holds as it ends."""
    def broken(*a, **k):
        raise RuntimeError("injected: the loop is broken")
    sched.next_batch = broken
    sched.abort_all = broken
    if not answers:
        sched.close = broken


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread is meant to die
@pytest.mark.parametrize("answers", [True, False], ids=["thread answers", "thread cannot answer"])
def test_a_dead_scheduler_thread_fails_every_call_at_once(tiny_model_dir, answers):
    """If the loop itself breaks (even its last-resort handler fails), the thread ends; callers
    waiting get an abort or a RuntimeError, never a wait for ever, and later calls raise at once."""
    eng = specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096)
    try:
        sched = eng.scheduler
        waiting = concurrent.futures.ThreadPoolExecutor(4)
        futures = [waiting.submit(lambda: eng.generate("a long one", LONG)) for _ in range(3)]
        time.sleep(0.2)
        break_the_loop(sched, answers)
        for f in futures:
            try:
                out = f.result(timeout=30)
            except RuntimeError as exc:
                assert "not running" in str(exc)
            else:
                assert out["meta_info"]["finish_reason"]["type"] == "abort"
        deadline = time.monotonic() + 10
        while eng.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.is_alive()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="not running"):
            eng.generate("later", SHORT)
        with pytest.raises(RuntimeError):
            eng.check_kv_invariant()
        info = eng.get_server_info()
        assert time.monotonic() - started < 5
        assert info["alive"] is False
        if answers:
            assert "injected" in info["error"]
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread is meant to die
@pytest.mark.parametrize("answers", [True, False], ids=["thread answers", "thread cannot answer"])
def test_a_dead_scheduler_thread_fails_every_async_caller(tiny_model_dir, answers):
    """Async callers, whole and streaming, waiting when the loop breaks: each gets an abort or a
    RuntimeError within a bounded time, also when the dying thread could answer nobody."""
    eng = specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096)
    try:
        sched = eng.scheduler
        outcomes: list[object] = []

        async def whole():
            try:
                outcomes.append((await eng.async_generate("a long one", LONG))["meta_info"]["finish_reason"]["type"])
            except RuntimeError as exc:
                outcomes.append(exc)

        async def streamed():
            try:
                async for chunk in await eng.async_generate("a long one", LONG, stream=True):
                    last = chunk
                outcomes.append(last["meta_info"]["finish_reason"]["type"])
            except RuntimeError as exc:
                outcomes.append(exc)

        async def main():
            async with anyio.create_task_group() as tg:
                for call in (whole, whole, streamed):
                    tg.start_soon(call)
                await anyio.sleep(0.2)
                break_the_loop(sched, answers)

        bounded(anyio.run, main, timeout=30)
        assert len(outcomes) == 3
        for outcome in outcomes:
            assert outcome == "abort" or (isinstance(outcome, RuntimeError) and "not running" in str(outcome)), outcome
        if not answers:  # nobody was answered: the watcher told every caller
            assert all(isinstance(o, RuntimeError) for o in outcomes)
    finally:
        eng.shutdown()


def test_waiting_async_callers_cost_their_event_loop_nothing(tiny_model_dir):
    """Two thousand async callers queued behind one long request: their event loop's thread stays
    idle while they wait (no caller wakes up to poll; a poll per caller a second kept the loop's
    thread, and with it the GIL the compute thread needs, busy)."""
    eng = specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, max_running_requests=1)
    try:
        async def main():
            with anyio.move_on_after(60):
                async with anyio.create_task_group() as tg:
                    for i in range(2000):
                        tg.start_soon(eng.async_generate, f"caller {i}", LONG)
                    while eng.scheduler.stats["requests_submitted"] < 2000:  # every caller submitted (each
                        await anyio.sleep(0.1)                             # validates in a worker thread) ...
                    await anyio.sleep(0.5)  # ... and parked in its wait
                    start = time.thread_time()
                    await anyio.sleep(2.5)
                    spent = time.thread_time() - start
                    tg.cancel_scope.cancel()  # aborts every request
            return spent

        spent = bounded(anyio.run, main, timeout=90)
        assert spent < 0.05, f"the event loop's thread ran {spent:.3f} s of 2.5 s while its callers waited"
        assert_released(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("spec", [None, "NGRAM"])
def test_sixteen_threads_and_a_shutdown_mid_flight(tiny_model_dir, spec):
    """Plain, grammar, sampled and streaming requests from 16 threads; ``shutdown()`` while they
    run: every call returns (a finish reason) or raises RuntimeError within a bounded time."""
    eng = specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=2048, max_running_requests=8,
                         speculative_algorithm=spec)
    kinds = ["plain", "grammar", "sampled", "stream"]
    results: dict[int, object] = {}

    def worker(i):
        kind = kinds[i % 4]
        for round_ in range(1000):
            try:
                if kind == "plain":
                    out = eng.generate(f"thread {i} round {round_}", dict(SHORT, max_new_tokens=30))
                elif kind == "grammar":
                    out = eng.generate(f"thread {i}", dict(SHORT, max_new_tokens=40, json_schema=SCHEMA))
                elif kind == "sampled":
                    out = eng.generate(f"thread {i}", {"temperature": 0.9, "top_p": 0.8, "max_new_tokens": 30})
                else:
                    out = list(eng.generate(f"thread {i}", dict(SHORT, max_new_tokens=30), stream=True))[-1]
                assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length", "abort")
            except RuntimeError as exc:
                results[i] = exc
                return

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    served = eng.get_server_info()["stats"]["requests_submitted"]
    bounded(eng.shutdown)
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a caller is still waiting after shutdown"
    eng.scheduler.check_kv_invariant()  # the loop's thread has ended: nothing owns a slot any more
    eng.scheduler.flush_cache()  # nor holds a cached prefix: the cache can give every slot back
    assert eng.scheduler.allocator.num_free_slots == eng.scheduler.allocator.size
    assert served >= 16
    assert len(results) == 16 and all("shut down" in str(e) or "not running" in str(e) for e in results.values())
