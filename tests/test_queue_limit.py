"""max_queued_requests: a submission that would take the queue of requests not yet started past the bound queues
nothing and raises QueueFullError (ValueError for a call larger than the bound, which no wait lets in); requests leave the count when they start or end unstarted (an abort, a refused
grammar), so the bound never leaks; a started request never counts."""
from __future__ import annotations

import time

import pytest

import specjet
from robustness_helpers import assert_healthy, bounded

HOLD = {"temperature": 0, "max_new_tokens": None, "ignore_eos": True}  # up to the context: keeps the one running slot busy
SHORT = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def test_the_bound_refuses_whole_submissions_and_frees_as_requests_start_or_end(tiny_model_dir):
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=8192, max_running_requests=1,
                        max_queued_requests=3) as eng:
        with pytest.raises(ValueError, match="can never fit max_queued_requests=3"):
            eng.generate(["a", "b", "c", "d"], SHORT)  # four in one call never fit: the caller's error, none queued
        assert eng.get_server_info()["stats"]["requests_submitted"] == 0
        assert len(bounded(eng.generate, ["a", "b", "c"], SHORT)) == 3  # three fit, and all three end

        holder = eng.generate("hold the slot", HOLD, stream=True)
        next(holder)  # it has started: it does not count
        queued = [eng.generate(p, SHORT, stream=True) for p in ("x", "y", "z")]  # wait behind it
        with pytest.raises(specjet.QueueFullError, match="max_queued_requests=3"):
            eng.generate("one too many", SHORT, stream=True)
        assert eng.get_server_info()["queued_requests"] == 3
        queued[0].close()  # aborted before it started: its place frees once the loop has seen the abort
        deadline = time.monotonic() + 30
        while eng.get_server_info()["queued_requests"] != 2:
            assert time.monotonic() < deadline, "the aborted request still counts"
            time.sleep(0.01)
        late = eng.generate("now it fits", SHORT, stream=True)
        with pytest.raises(specjet.QueueFullError):
            eng.generate("one too many", SHORT, stream=True)
        holder.close()
        outs = [bounded(list, s) for s in (*queued[1:], late)]
        assert all(o[-1]["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
        assert eng.get_server_info()["queued_requests"] == 0  # the whole bound is free again
        assert len(bounded(eng.generate, ["p", "q", "r"], SHORT)) == 3
        assert_healthy(eng)


def test_a_refused_grammar_leaves_the_count(tiny_model_dir):
    """Requests that end while waiting (a grammar that fails to compile) are counted out, so refusals cannot
    fill the bound for good."""
    endless = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # no finite instance
    bad = dict(SHORT, json_schema=endless)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, max_queued_requests=2) as eng:
        with pytest.raises(ValueError, match="no finite output"):  # within the door's wait for the compile: refused
            eng.generate(["1", "2"], bad)
        eng.scheduler.grammar_backend.door_compile_wait_s = 0.0  # a compile slower than the door's wait: it ends them
        for _ in range(5):
            out = bounded(eng.generate, ["1", "2"], bad)
            assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out)
            assert "no finite output" in out[0]["meta_info"]["finish_reason"]["message"]
        assert eng.get_server_info()["queued_requests"] == 0
        assert len(bounded(eng.generate, ["1", "2"], SHORT)) == 2
        assert_healthy(eng)


def test_the_bound_is_checked_at_the_door(tiny_model_dir):
    for bad, error in ((0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_queued_requests"):
            specjet.EngineArgs.from_kwargs(model_path=str(tiny_model_dir), max_queued_requests=bad)
