"""`vllm serve` as the tool runs it: started with the probe in every
process, its processes placed (`cores`), its counters read, and its
connector mode switched and checked in every process, all through the
probe's control channel (`wire`)."""

from __future__ import annotations

import contextlib
import enum
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvfill_patch.fidelity.cores import Placement, put_first
from vllm_kvfill_patch.fidelity.transfers import Source, Transfers, read_transfers
from vllm_kvfill_patch.fidelity.wire import (
    ANSWERS,
    COUNTS,
    DIR_ENV,
    FILL_BUCKETS,
    QUESTIONS,
    REQUEST_LISTS,
    Setting,
    counted,
    question_line,
)

SITE = (
    "import vllm_kvfill_patch.fidelity.probe as probe\n"
    "import vllm_kvfill_patch.fidelity.nixl_rest as nixl_rest\n"
    "probe.install()\n"
    "nixl_rest.install()\n"
    "probe.run_hidden_sitecustomize(__file__)\n"
)
"""The `sitecustomize` that puts the probe in every process vLLM starts (and
rests NIXL's progress thread where the tool asks: `nixl_rest`), and then
runs the one it hides."""


def vllm_command() -> str:
    """The `vllm` console script of this interpreter's environment."""
    return str(Path(sys.executable).with_name("vllm"))


_HANDED_OUT: set[int] = set()


def metrics_page(base_url: str) -> str:
    """The server's Prometheus page of vLLM's metrics."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as page:
        return page.read().decode()


def free_port() -> int:
    """A port nothing listens on now, and not handed out before by this
    process: servers started together each get their own."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


NOT_UP = "not up after"
"""How `Server.wait_until_healthy` says its time ran out."""
PORT_TAKEN = "Address already in use"
PORT_ATTEMPTS = 3
"""A server whose port another process took before vLLM bound it (its
engine and worker processes, or another program, take ports of their own
meanwhile) is started again on another port, up to this many times."""


class Phase(str, enum.Enum):
    """How the proxy routes a request, where a prefill server stands behind
    it."""

    DECODE = "decode"
    """Prefill, then decode: a prompt prefilled ahead is replayed instead."""
    AHEAD = "ahead"
    """Prefill only, its transfer parameters kept by prompt (the client gets
    a one-token answer), so that a replay decodes the same prompts alone,
    its cores not shared with prefill work."""
    REPLAY = "replay"
    """Decode only, of prompts prefilled ahead: the prefill server is paused
    (`node.DecodeNode.pause_prefill`), so a prompt not prefilled ahead is
    refused (502), not prefilled."""


@dataclass
class Proxy:
    """The tool's proxy process (`proxy`), in front of one server or a pair."""

    decode_url: str
    prefill_url: str | None
    log: Path
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, cores: frozenset[int] | None) -> None:
        """Started on `cores` (the client's, where given)."""
        self.port = free_port()
        command = [
            sys.executable, "-m", "vllm_kvfill_patch.fidelity.proxy",
            "--port", str(self.port), "--decode", self.decode_url,
        ]  # fmt: skip
        if self.prefill_url:
            command += ["--prefill", self.prefill_url]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        if cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.process.pid, cores)

    def ask(self, path: str, body: dict | None = None) -> dict:
        """The proxy's answer at `path` (a POST of `body` where given)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            return json.loads(reply.read())

    def route(self, phase: Phase) -> None:
        """Requests routed as `phase` says from now on."""
        self.ask("/phase", {"phase": phase.value})

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(30)
            if self.process.poll() is None:
                self.process.kill()


@dataclass
class Server:
    """One `vllm serve`, its log and its probe's counters."""

    name: str
    arguments: list[str]
    env: dict[str, str]
    directory: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    placement: Placement | None = None
    questions: int = 0
    """Questions asked of its probes (`counters`, `switch`)."""
    switches: int = 0
    """Switches of its connector mode, each checked in every process."""
    fronted: bool = True
    """Whether the tool's proxy stands in front of it: vLLM's client reaches
    every mode through one, so that its hop is in every leg."""
    proxy: Proxy | None = None
    carried: dict[int, list[Transfers]] = field(default_factory=dict)
    """What each linked leg's requests received over the package's emulated
    link, by concurrency, as vLLM's metrics count it."""
    carried_before: Transfers | None = None

    @property
    def log(self) -> Path:
        return self.directory / "serve.log"

    @property
    def probe_dir(self) -> Path:
        return self.directory / "probe"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client_url(self) -> str:
        """Where vLLM's client sends its requests: the proxy, where one
        stands in front."""
        return self.proxy.url if self.proxy is not None else self.base_url

    def new_proxy(self) -> Proxy:
        return Proxy(self.base_url, None, self.directory / "proxy.log")

    def prepare(self, bench: Callable[[str, Path], dict], result: Path) -> bool:
        """What a leg needs before vLLM's client measures it, run with
        `bench`; whether anything ran: nothing here (`node.DecodeNode`
        prefills the leg's prompts)."""
        return False

    def leg_begins(self) -> None:
        """What `check` counts from, taken as the leg begins (after its
        warm-up): the emulated link's transfers (`node.DecodeNode` reads
        NIXL's)."""
        self.carried_before = read_transfers(
            metrics_page(self.base_url), Source.EMULATED
        )

    def started(self) -> list[str]:
        """The `vllm serve` processes it started, by name."""
        return [self.name]

    def transfers(self, concurrency: int | None = None) -> Transfers | None:
        """What it received through NIXL (at `concurrency`, else in all):
        None here (a server that takes no KV from another)."""
        return None

    def prefill_paused(self) -> str | None:
        """How its prefill server's engine core was paused while its legs
        were measured, in words: None here (`node.DecodeNode`)."""
        return None

    def cores_said(self, placement: Placement) -> str:
        """Where its processes run, in words."""
        return placement.describe()

    def check(self, requests: int, concurrency: int) -> None:
        """Raises where a leg of `requests` requests at `concurrency` was not
        served as the mode says: nothing to check here (`node.DecodeNode`
        checks its KV arrived through NIXL); a leg's transfers over the
        emulated link are kept."""
        if self.carried_before is None:
            return
        page = metrics_page(self.base_url)
        carried = read_transfers(page, Source.EMULATED).minus(self.carried_before)
        if carried.count:
            self.carried.setdefault(concurrency, []).append(carried)

    def link_carried(self) -> Transfers | None:
        """What its linked legs' requests received over the emulated link."""
        legs = [leg for legs in self.carried.values() for leg in legs]
        return functools.reduce(Transfers.plus, legs) if legs else None

    def start(self) -> None:
        self.probe_dir.mkdir(parents=True, exist_ok=True)
        site = self.directory / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITE)
        path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
        env = {
            **os.environ,
            **self.env,
            "PYTHONPATH": path,
            DIR_ENV: str(self.probe_dir),
        }
        command = [
            vllm_command(), "serve", *self.arguments,
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        with self.log.open("w") as out:
            # A session of its own: stop() ends vLLM's engine and worker
            # processes with it, not only the API server.
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if self.proxy is not None:  # started again on another port
            self.proxy.stop()
        if self.fronted:
            self.proxy = self.new_proxy()
            self.proxy.start(None)

    def wait_until_healthy(self, timeout: float) -> str | None:
        """None once /health answers through the proxy; else why not (the
        log's first error)."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        attempts = 1
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = self.log.read_text(errors="replace")
                if PORT_TAKEN in log and attempts < PORT_ATTEMPTS:
                    attempts += 1
                    self.port = free_port()
                    self.start()
                    continue
                return first_error(log)
            try:
                with urllib.request.urlopen(f"{self.client_url}/health", timeout=5):
                    return None
            except OSError:
                time.sleep(1)
        return f"{NOT_UP} {timeout:.0f} s"

    def place(self) -> Placement | None:
        """Keeps its processes but its workers off the workers' cores
        (`cores`), again before each run: threads started since move too."""
        assert self.process is not None
        if self.placement is None:
            self.placement = Placement.find(self.process.pid)
        if self.placement is not None:
            self.placement.apply(self.process.pid)
            self.place_proxy(self.placement)
        return self.placement

    def place_proxy(self, placement: Placement) -> None:
        """The proxy on the front cores, first there where the API server is."""
        if self.proxy is None or self.proxy.process is None:
            return
        with contextlib.suppress(OSError):  # ended: the leg says why
            os.sched_setaffinity(self.proxy.process.pid, placement.front_cores)
        if placement.first:
            put_first(self.proxy.process.pid)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def pause(self) -> None:
        """Every process of the server stopped (``SIGSTOP`` to its process
        group), idle or not, while another server is measured."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _signal_group(self, sent: signal.Signals) -> None:
        if self.alive():
            assert self.process is not None
            with contextlib.suppress(ProcessLookupError):  # ended: its leg says why
                os.killpg(self.process.pid, sent)

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.process is None:
            return
        self.resume()  # a stopped process takes SIGTERM once it runs
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(60)
                break
            except subprocess.TimeoutExpired:
                continue

    def counters(self) -> dict:
        """The sum of every process's probe counters and the engine's
        preemptions (Prometheus), now; and the forward passes its workers
        took (`steps`), and what its requests recorded (`wire.REQUEST_LISTS`)
        since the last question."""
        self.questions += 1
        answered = ask(self.probe_dir, self.questions)
        total: dict = dict.fromkeys(COUNTS, 0)
        total["fill_histogram"] = [0] * FILL_BUCKETS
        for path in self.probe_dir.glob(f"*{ANSWERS}"):
            counts = json.loads(path.read_text())
            for key in COUNTS:
                total[key] = counted(total[key], counts[key])
        answers = [json.loads(path.read_text()) for path in answered]
        total["steps"] = [step for answer in answers for step in answer["steps"]]
        for key in REQUEST_LISTS:
            total[key] = [value for answer in answers for value in answer[key]]
        total["preemptions"] = self.metric("vllm:num_preemptions_total")
        return total

    def switch(self, setting: Setting) -> None:
        """Puts `setting` in force in every process of the server, and checks
        that each did: raises RuntimeError naming each that did not, or where
        no process has the tool's connector on both sides."""
        self.questions += 1
        answered = ask(self.probe_dir, self.questions, setting)
        problems, roles = [], set()
        for path in answered:
            state = json.loads(path.read_text())["switch"] or {"error": "no answer"}
            name = f"process {path.stem}"
            if "error" in state:
                problems.append(f"{name}: {state['error']}")
            elif said := mismatch(setting, state):
                problems.append(f"{name}: {said}")
            else:
                roles.update(state.get("connectors", []))
        if not problems and not {"SCHEDULER", "WORKER"} <= roles:
            problems.append(f"connectors seen: {sorted(roles)}, not both sides")
        if problems:
            raise RuntimeError(
                f"{self.name}: not switched to {setting.encoded()}: "
                + "; ".join(problems)
            )
        self.switches += 1

    def metric(self, name: str) -> float:
        """A Prometheus counter, summed over its labels."""
        text = metrics_page(self.base_url)
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
        return sum(float(value) for value in pattern.findall(text))

    def kernels(self) -> list[str]:
        """The vLLM kernel libraries its processes loaded (`wire.Answer`)."""
        found: set[str] = set()
        for path in self.probe_dir.glob(f"*{ANSWERS}"):
            found.update(json.loads(path.read_text()).get("kernels", []))
        return sorted(found)

    def processes(self) -> list[dict]:
        """Where each of its processes last ran (`wire.Answer`)."""
        return [
            json.loads(path.read_text()).get("placement")
            for path in sorted(self.probe_dir.glob(f"*{ANSWERS}"))
        ]

    def decisions(self) -> list[str]:
        """The decisions this package's log lines name, one per process."""
        return re.findall(
            r"vllm-kvfill-patch (\w+) for vLLM", self.log.read_text(errors="replace")
        )


ANSWER_SECONDS = 30.0
"""How long :func:`ask` waits for a live process's answer: a process that
takes longer is hung."""


def ask(directory: Path, question: int, setting: Setting | None = None) -> list[Path]:
    """Has every live process that counts into `directory` save its counters,
    marked `question` (larger than any asked before), after putting
    `setting` in force where one is given, and waits until each has; returns
    their answers' files. A process whose FIFO has no reader has ended; its
    last counts stay."""
    message = question_line(question, setting).encode()
    waiting = []
    for fifo in directory.glob(f"*{QUESTIONS}"):
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no reader
            continue
        try:
            os.write(writer, message)
        finally:
            os.close(writer)
        waiting.append(fifo.with_suffix(ANSWERS))
    asked = list(waiting)
    deadline = time.monotonic() + ANSWER_SECONDS
    while waiting := [path for path in waiting if answered(path) < question]:
        if time.monotonic() > deadline:
            names = ", ".join(path.stem for path in waiting)
            raise RuntimeError(f"the probe in process {names} did not answer")
        time.sleep(0.005)
    return asked


def answered(path: Path) -> int:
    """The last question the answer at `path` answers (0 before any, -1
    before the process first saved it)."""
    try:
        return json.loads(path.read_text())["answered"]
    except FileNotFoundError:
        return -1


def mismatch(setting: Setting, state: dict) -> str | None:
    """How a process's state after a switch (`wire.InForce`) differs from
    `setting`, or None (also for a process without the connector)."""
    if "skipped" in state:
        return None
    problems = []
    if state["decision"] != setting.decision:
        problems.append(f"decision {state['decision']}, not {setting.decision}")
    if state["writes"] != setting.writes:
        problems.append(f"writes {state['writes']}, not {setting.writes}")
    refill = setting.refill and setting.package
    if any(found is not refill for found in state["refill"]):
        problems.append(f"refill {state['refill']}, not {refill}")
    link = (
        [*setting.link, setting.sharing] if setting.link and setting.package else None
    )
    if any(found != link for found in state.get("link", [])):
        problems.append(f"link {state['link']}, not {link}")
    return "; ".join(problems) or None


EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)\w*: .*)$")


def logged_exception(log: str) -> str | None:
    """The first exception a vLLM process logged (its root cause, as vLLM's
    worker logs it before the engine core and the API server report it)."""
    for line in log.splitlines():
        if " WARNING " in line or " INFO " in line:
            continue
        found = EXCEPTION_LINE.match(line.rsplit("] ", 1)[-1].strip())
        if found:
            return found[1]
    return None


def first_error(log: str) -> str:
    """Why a vLLM process stopped: `logged_exception`, else its last line."""
    if (exception := logged_exception(log)) is not None:
        return exception
    lines = log.strip().splitlines()
    return lines[-1].strip() if lines else "exited with no output"
