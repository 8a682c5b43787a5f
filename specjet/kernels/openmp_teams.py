"""Keeping libgomp's worker threads spinning while the engine computes on its own thread.

torch's CPU ops (and this package's C++ kernels, through ``at::parallel_for``) run their parallel
regions on OpenMP. GNU OpenMP gives every thread that opens a parallel region a team of its own, and
once the teams' threads together outnumber the CPUs it stops letting idle workers spin between
regions: they sleep on a futex and each of the few hundred regions of a decode step then pays a
wake-up. The engine's forwards run on its compute thread, and the thread that built the engine (the
user's, usually the main thread) keeps the team the model's loading opened; on a 2-core machine
those two teams alone are enough to put every worker to sleep, and a decode step costs ~1.5x what
the same forward costs on the loading thread.

``release_calling_thread_team`` frees the calling thread's team (OpenMP 5's
``omp_pause_resource_all``; the team is created again if that thread opens another parallel
region). The engine calls it on the thread that built it, once loading is done. It does nothing
where torch does not run on GNU OpenMP.

A thread that computes for an engine (the plain loop's scheduler thread, the overlap loop's compute
thread) keeps its team while it idles (``IdleTeam``): building the team again costs the next request
milliseconds (bench/RESULTS.md, session 54). It gives the team back only when another such thread
computes (another engine in the process, whose workers would otherwise sleep) or after
``KEEP_IDLE_TEAM_S`` of idling. And it binds its team's threads to one CPU each (``pin_calling_team``,
what OMP_PROC_BIND=true does for a process that sets it before OpenMP starts): unbound, the workers
that slept through an idle spell wake on whatever CPU the kernel picks, often their master's, and the
first forward after the pause ran several times slower (session 54); ``SPECJET_PIN_THREADS=0`` leaves them unbound.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
import time

import torch

_RTLD_NOLOAD = getattr(os, "RTLD_NOLOAD", 4)  # open only what is already loaded

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime's state

PIN_ENV = "SPECJET_PIN_THREADS"
_TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/{}"


def _core_of(cpu: int) -> tuple[int, int] | None:
    """(package, core) of a logical CPU from sysfs, or None where the kernel does not say."""
    try:
        with open(_TOPOLOGY.format(cpu, "physical_package_id")) as package, open(_TOPOLOGY.format(cpu, "core_id")) as core:
            return int(package.read()), int(core.read())
    except (OSError, ValueError):
        return None


def cores_first(cpus: list[int], core_of=_core_of) -> list[int]:
    """``cpus`` ordered so that a team takes one hardware thread of each physical core before any core's
    second (SMT siblings are numbered apart on some machines, side by side on others): the first CPU of
    every core in (package, core) order, then the second ones, ... Numeric order where the topology is
    unknown."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(cpus):
        core = core_of(cpu)
        if core is None:
            return sorted(cpus)
        cores.setdefault(core, []).append(cpu)
    groups = [cores[k] for k in sorted(cores)]
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


# The CPUs this process may run on, read once (at import, normally on the main thread: a pinned thread's
# own set is its one CPU), physical cores first.
_PROCESS_CPUS = cores_first(list(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else []


@functools.lru_cache(maxsize=1)
def _libgomp() -> ctypes.CDLL | None:
    """torch's own libgomp (already loaded by torch, so this opens the same copy), or None."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    name = path if os.path.exists(path) else "libgomp.so.1"
    try:
        lib = ctypes.CDLL(name, mode=_RTLD_NOLOAD)
    except OSError:  # not loaded under that name: torch uses another OpenMP runtime
        return None
    if not hasattr(lib, "omp_pause_resource_all"):  # an OpenMP runtime older than 5.0
        return None
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    return lib


def release_calling_thread_team() -> bool:
    """Free the OpenMP team of the calling thread; True where it was done. Never raises: the engine's
    compute thread calls it between work items, and an exception there would end the thread."""
    try:
        lib = _libgomp()
        rc = -1 if lib is None else lib.omp_pause_resource_all(_OMP_PAUSE_SOFT)
    except Exception:  # an optimisation only: a failure leaves the team in place
        logger.debug("freeing the OpenMP team failed", exc_info=True)
        return False
    return rc == 0


KEEP_IDLE_ENV = "SPECJET_IDLE_TEAM_S"


def keep_idle_seconds(text: str | None) -> float:
    """``SPECJET_IDLE_TEAM_S``: seconds an idle computing thread keeps its team (default 10; 0 frees it at the
    first idle poll). Keeping it spares the next request rebuilding it (~2 ms); meanwhile the process's other
    threads' OpenMP regions (torch work of the application's own) wake their workers from sleep each time,
    since the idle team counts against the cores. An unreadable value is logged and the default kept."""
    if text is None or not text.strip():
        return 10.0
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0.0 <= value < float("inf")):
        logger.warning("%s=%r is not a number of seconds >= 0; keeping 10", KEEP_IDLE_ENV, text)
        return 10.0
    return value


# An idle computing thread keeps its team this long unless another one computes (then it frees it at once).
KEEP_IDLE_TEAM_S = keep_idle_seconds(os.environ.get(KEEP_IDLE_ENV))

_computing: set[int] = set()  # the idents of the threads computing for an engine now
_computing_lock = threading.Lock()


# Where each computing thread's team starts in the process's CPU list (by thread ident): engines in one process
# take consecutive blocks of CPUs, so two that compute at once on a machine with the CPUs for both do not share.
_team_starts: dict[int, int] = {}
_next_start = 0
_starts_lock = threading.Lock()


def team_cpus(cpus: list[int], start: int, team: int) -> list[int]:
    """The CPUs of a team of ``team`` threads whose block starts at ``cpus[start]``: thread t's is entry t
    (around the list where the team outnumbers it)."""
    return [cpus[(start + t) % len(cpus)] for t in range(team)]


def pin_calling_team() -> bool:
    """Bind the calling thread's OpenMP team (itself and its workers, creating them if need be) to one CPU
    each of the process's set: the calling thread's first time, the next free block of CPUs, kept when it
    binds a new team later. True where every thread was bound. Never raises (an optimisation only)."""
    global _next_start
    if os.environ.get(PIN_ENV, "1").strip() == "0" or not _PROCESS_CPUS:
        return False
    try:
        from specjet.kernels.cpu_ops import extension

        ext = extension()
        if ext is None or not hasattr(ext, "pin_team_threads"):
            return False
        team = torch.get_num_threads()
        with _starts_lock:
            start = _team_starts.get(threading.get_ident())
            if start is None:
                start = _team_starts[threading.get_ident()] = _next_start
                _next_start = (_next_start + team) % len(_PROCESS_CPUS)
        return min(ext.pin_team_threads(team_cpus(_PROCESS_CPUS, start, team))) >= 0
    except Exception:
        logger.debug("binding the OpenMP team to CPUs failed", exc_info=True)
        return False


class IdleTeam:
    """The OpenMP team of a thread that computes for an engine, across its idle spells: ``busy()`` before it
    computes (the first time, and after its team was freed, it binds the team's threads to CPUs: ``pin``),
    ``idle()`` each time it finds nothing to do (it then frees its team once another engine's thread
    computes, or after KEEP_IDLE_TEAM_S). Used by that thread alone."""

    def __init__(self, pin: bool = True):
        self._idle_since: float | None = None
        self._marked = False  # in _computing
        self._pin, self._pinned = pin, 0  # the team size last bound (0: none): a new size is a new team
        self.released = False

    def busy(self) -> None:
        if not self._marked:
            with _computing_lock:
                _computing.add(threading.get_ident())
            self._marked = True
        if self._pin and self._pinned != torch.get_num_threads():
            pin_calling_team()
            self._pinned = torch.get_num_threads()  # tried: a thread that cannot be bound is not tried every step
        self._idle_since, self.released = None, False

    def idle(self) -> None:
        with _computing_lock:
            _computing.discard(threading.get_ident())
            others = bool(_computing)
        self._marked = False
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if not self.released and (others or now - self._idle_since >= KEEP_IDLE_TEAM_S):
            release_calling_thread_team()
            self.released, self._pinned = True, 0  # a new team's workers are new threads

    def close(self) -> None:
        """The thread stops computing for good."""
        with _computing_lock:
            _computing.discard(threading.get_ident())
        self._marked = False
