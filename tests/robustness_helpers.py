"""Helpers for the robustness tests: calls that must come back within a bound, and the engine's
health checked after a workload (thread alive, nothing waiting, no KV slot leaked)."""
from __future__ import annotations

import concurrent.futures

# Generous: a tiny-model request takes milliseconds; a call still waiting after this is hung.
CALL_TIMEOUT_S = 60.0

_pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="test-caller")


def submit(fn, *args, **kwargs) -> concurrent.futures.Future:
    """Run ``fn`` on another thread now; wait on the future with a timeout."""
    return _pool.submit(fn, *args, **kwargs)


def bounded(fn, *args, timeout: float = CALL_TIMEOUT_S, **kwargs):
    """Run ``fn`` on another thread; its result, its exception, or AssertionError if it hangs."""
    future = _pool.submit(fn, *args, **kwargs)
    try:
        return future.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not return within {timeout} s") from None


def assert_healthy(engine) -> None:
    """The scheduler thread lives, the engine drains, and free + owned KV == the pool."""
    assert engine.is_alive(), "the scheduler thread died"
    bounded(engine.wait_idle)
    bounded(engine.check_kv_invariant)
