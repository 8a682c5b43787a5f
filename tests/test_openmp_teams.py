"""Freeing a thread's OpenMP team (kernels/openmp_teams.py): the team's worker threads really go, and an idle
engine thread frees its team only when another engine computes (or after a long idle)."""
import os
import threading
import time

import pytest
import torch

from specjet.kernels import openmp_teams
from specjet.kernels.openmp_teams import _libgomp, release_calling_thread_team

pytestmark = pytest.mark.skipif(_libgomp() is None or (os.cpu_count() or 1) < 2,
                                reason="torch does not run on GNU OpenMP here, or one CPU")


@pytest.fixture(autouse=True)
def two_threads():
    """Teams of two threads, also under pytest-xdist (whose workers get one thread each, conftest.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_thread_count() -> int:
    """The thread count once an earlier test's threads have finished exiting (two readings 0.1 s apart agree)."""
    last, end = _thread_count(), time.monotonic() + 5
    while time.monotonic() < end:
        time.sleep(0.1)
        now = _thread_count()
        if now == last:
            return now
        last = now
    return last


def _wait_for(predicate, timeout=5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_release_frees_the_calling_threads_workers():
    """A fresh thread opens a team with its first parallel region (its workers are new OS threads)
    and releasing it ends them; the thread still computes afterwards (the team comes back)."""
    result = {}

    def body():
        a = torch.randn(512, 512)
        before = _thread_count()
        expected = a @ a  # a parallel region: the team's workers start
        result["with_team"] = _thread_count()
        result["released"] = release_calling_thread_team()
        result["gone"] = _wait_for(lambda: _thread_count() <= before)
        result["same"] = torch.equal(a @ a, expected)
        result["before"] = before

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert result["with_team"] > result["before"]
    assert result["released"] is True
    assert result["gone"], "the released team's workers did not exit"
    assert result["same"]


def test_release_without_a_team_is_harmless():
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("ok", release_calling_thread_team()))
    t.start()
    t.join()
    assert result["ok"] is True


def test_an_idle_compute_stream_keeps_its_team_until_another_thread_computes():
    """The overlap loop's compute thread keeps its team while idle (the next item does not build it again),
    gives it back once another engine's thread computes, and computes again after."""
    from specjet.scheduler.streams import IDLE_POLL_S, CpuStream

    before = _settled_thread_count()
    stream, other = CpuStream(), openmp_teams.IdleTeam(pin=False)
    try:
        a = torch.randn(512, 512)
        expected, with_team = stream.submit(lambda: (a @ a, _thread_count())).result()
        assert with_team > before + 1  # the stream's thread and its team's workers
        time.sleep(4 * IDLE_POLL_S)  # idle, alone: the team stays
        assert _thread_count() == with_team
        other.busy()  # this thread now computes for an engine
        assert _wait_for(lambda: _thread_count() <= before + 1), "the idle stream kept its team beside a busy engine"
        assert torch.equal(stream.submit(lambda: a @ a).result(), expected)
    finally:
        other.close()
        stream.close()


def test_an_idle_compute_stream_frees_its_team_after_a_long_idle(monkeypatch):
    from specjet.scheduler.streams import CpuStream

    monkeypatch.setattr(openmp_teams, "KEEP_IDLE_TEAM_S", 0.2)
    before = _settled_thread_count()
    stream = CpuStream()
    try:
        a = torch.randn(512, 512)
        with_team = stream.submit(lambda: (a @ a, _thread_count())[1]).result()
        assert with_team > before + 1
        assert _wait_for(lambda: _thread_count() <= before + 1), "the stream kept its team past KEEP_IDLE_TEAM_S"
    finally:
        stream.close()


def test_the_plain_loop_keeps_its_team_while_idle_alone(tiny_model_dir):
    """The plain loop computes on its own thread: idle, it keeps that thread's team (a request after a pause
    does not build it again) until another engine's thread computes."""
    import specjet

    other = openmp_teams.IdleTeam(pin=False)
    with specjet.Engine(model_path=str(tiny_model_dir), max_total_tokens=4096, disable_overlap_schedule=True) as eng:
        try:
            eng.generate("Hello there", {"temperature": 0, "max_new_tokens": 4})
            if len(openmp_teams._PROCESS_CPUS) >= 2:  # its forwards' thread is bound to a CPU of its own
                start = openmp_teams._team_starts[eng._thread.ident]
                assert _allowed_cpus(eng._thread.native_id) == str(openmp_teams._PROCESS_CPUS[start])
            with_team = _settled_thread_count()
            time.sleep(0.3)  # six of the idle loop's waits
            assert _thread_count() == with_team
            other.busy()
            assert _wait_for(lambda: _thread_count() < with_team), "the idle plain loop kept its team"
            other.close()
            assert eng.generate("Hello there", {"temperature": 0, "max_new_tokens": 4})["output_ids"]
            eng.check_kv_invariant()
        finally:
            other.close()


def _allowed_cpus(native_id: int) -> str:
    for line in open(f"/proc/self/task/{native_id}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


needs_two_cpus = pytest.mark.skipif(len(openmp_teams._PROCESS_CPUS) < 2, reason="one CPU: nothing to bind apart")


@needs_two_cpus
def test_pinning_binds_each_thread_of_the_team_to_its_own_cpu(monkeypatch):
    """The calling thread goes to the process's first CPU and each worker to the next ones (what
    OMP_PROC_BIND=true does); the team still computes the same; SPECJET_PIN_THREADS=0 binds nothing."""
    cpus = openmp_teams._PROCESS_CPUS
    result = {}

    def body():
        a = torch.randn(256, 256)
        expected = a @ a
        result["pinned"] = openmp_teams.pin_calling_team()
        result["mine"] = _allowed_cpus(threading.get_native_id())
        result["start"] = openmp_teams._team_starts[threading.get_ident()]
        result["workers"] = sorted(_allowed_cpus(int(t)) for t in os.listdir("/proc/self/task")
                                   if int(t) != threading.get_native_id())
        result["same"] = torch.equal(a @ a, expected)
        release_calling_thread_team()

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert result["pinned"] is True and result["same"]
    team = torch.get_num_threads()
    block = openmp_teams.team_cpus(cpus, result["start"], team)
    assert result["mine"] == str(block[0])
    assert sum(w in {str(c) for c in block[1:]} for w in result["workers"]) >= team - 1

    monkeypatch.setenv(openmp_teams.PIN_ENV, "0")
    off = {}

    def unpinned():
        off["pinned"] = openmp_teams.pin_calling_team()
        off["mine"] = _allowed_cpus(threading.get_native_id())

    t = threading.Thread(target=unpinned)
    t.start()
    t.join()
    assert off["pinned"] is False and ("," in off["mine"] or "-" in off["mine"])  # still every CPU


def test_the_idle_keep_comes_from_the_environment_and_bad_values_keep_the_default(caplog):
    assert openmp_teams.keep_idle_seconds(None) == 10.0 and openmp_teams.keep_idle_seconds(" ") == 10.0
    assert openmp_teams.keep_idle_seconds("0") == 0.0 and openmp_teams.keep_idle_seconds("2.5") == 2.5
    for bad in ("-1", "nan", "inf", "soon"):
        caplog.clear()
        assert openmp_teams.keep_idle_seconds(bad) == 10.0
        assert any(openmp_teams.KEEP_IDLE_ENV in r.getMessage() and repr(bad) in r.getMessage()
                   for r in caplog.records), bad


def test_teams_take_one_thread_of_each_core_first():
    siblings_apart = {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (0, 3), 4: (0, 0), 5: (0, 1), 6: (0, 2), 7: (0, 3)}
    siblings_together = {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1), 4: (1, 0), 5: (1, 0)}
    assert openmp_teams.cores_first(list(range(8)), siblings_apart.get) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert openmp_teams.cores_first(list(range(6)), siblings_together.get) == [0, 2, 4, 1, 3, 5]
    assert openmp_teams.cores_first([3, 1, 2], lambda cpu: None) == [1, 2, 3]  # no topology: numeric order
    assert openmp_teams.cores_first([5, 4], siblings_together.get) == [4, 5]  # one core's two threads


def test_teams_take_consecutive_blocks_of_cpus():
    assert openmp_teams.team_cpus([0, 1, 2, 3], 0, 2) == [0, 1]
    assert openmp_teams.team_cpus([0, 1, 2, 3], 2, 2) == [2, 3]
    assert openmp_teams.team_cpus([4, 5, 6], 2, 3) == [6, 4, 5]  # around the list
    assert openmp_teams.team_cpus([0, 1], 0, 3) == [0, 1, 0]  # more threads than CPUs


def test_a_failing_binding_neither_raises_nor_stops_the_stream(monkeypatch):
    """The compute thread binds its team before its first item: an op that fails there must not end the thread
    (the item's caller would wait for ever); the item runs unbound."""
    from specjet.kernels import cpu_ops
    from specjet.scheduler.streams import CpuStream

    class Broken:
        def __getattr__(self, name):
            if name == "pin_team_threads":
                def fail(cpus):
                    raise RuntimeError("injected binding failure")
                return fail
            raise AttributeError(name)

    monkeypatch.setattr(cpu_ops, "extension", lambda: Broken())
    assert openmp_teams.pin_calling_team() is False
    stream = CpuStream()
    try:
        assert stream.submit(lambda: 1).result(timeout=10) == 1
        assert stream.submit(lambda: 2).result(timeout=10) == 2
    finally:
        stream.close()


def test_a_failing_release_neither_raises_nor_stops_the_stream(monkeypatch):
    """The compute thread frees its team between work items: a failure there must not end the thread
    (every caller waiting on a future would wait for ever)."""
    from specjet.scheduler.streams import IDLE_POLL_S, CpuStream

    def broken():
        raise OSError("no libgomp")

    monkeypatch.setattr(openmp_teams, "_libgomp", broken)
    monkeypatch.setattr(openmp_teams, "KEEP_IDLE_TEAM_S", 0.0)  # an idle stream releases at once
    assert release_calling_thread_team() is False
    stream = CpuStream()
    try:
        assert stream.submit(lambda: 1).result(timeout=10) == 1
        time.sleep(3 * IDLE_POLL_S)  # the stream went idle and tried to release
        assert stream.submit(lambda: 2).result(timeout=10) == 2
    finally:
        stream.close()
