"""`vllm serve` and `vllm bench serve` as the tool runs them."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvfill_patch.fidelity import probe
from vllm_kvfill_patch.fidelity.cores import Placement

COUNTS = (
    "reprefilled_tokens",
    "expert_forwards",
    "expert_imbalance_sum",
    "subnormal_outputs",
    "checked_outputs",
    "fill_calls",
    "fill_seconds",
    "fill_histogram",
)
"""The probe's counters, summed over a server's processes (a histogram
bucket by bucket)."""
SITE = (
    "import vllm_kvfill_patch.fidelity.probe as probe\n"
    "probe.install()\n"
    "probe.run_hidden_sitecustomize(__file__)\n"
)
"""The `sitecustomize` that puts the probe in every process vLLM starts, and
then runs the one it hides."""


def vllm_command() -> str:
    """The `vllm` console script of this interpreter's environment."""
    return str(Path(sys.executable).with_name("vllm"))


_HANDED_OUT: set[int] = set()


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


PORT_TAKEN = "Address already in use"
PORT_ATTEMPTS = 3
"""A server whose port another process took before vLLM bound it (its
engine and worker processes, or another program, take ports of their own
meanwhile) is started again on another port, up to this many times."""


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
    """Questions asked of its probes (`counters`)."""

    @property
    def log(self) -> Path:
        return self.directory / "serve.log"

    @property
    def probe_dir(self) -> Path:
        return self.directory / "probe"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
            probe.DIR_ENV: str(self.probe_dir),
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

    def wait_until_healthy(self, timeout: float) -> str | None:
        """None once /health answers; else why not (the log's first error)."""
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
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5):
                    return None
            except OSError:
                time.sleep(1)
        return f"not up after {timeout:.0f} s"

    def place(self) -> Placement | None:
        """Keeps its processes but its workers off the workers' cores
        (`cores`), again before each run: threads started since move too."""
        assert self.process is not None
        if self.placement is None:
            self.placement = Placement.find(self.process.pid)
        if self.placement is not None:
            self.placement.apply(self.process.pid)
        return self.placement

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None:
            return
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
        preemptions (Prometheus), now."""
        self.questions += 1
        probe.ask(self.probe_dir, self.questions)
        total: dict = dict.fromkeys(COUNTS, 0)
        total["fill_histogram"] = [0] * probe.FILL_BUCKETS
        for path in self.probe_dir.glob("*.json"):
            counts = json.loads(path.read_text())
            for key in COUNTS:
                total[key] = probe.counted(total[key], counts[key])
        total["preemptions"] = self.metric("vllm:num_preemptions_total")
        return total

    def metric(self, name: str) -> float:
        """A Prometheus counter, summed over its labels."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=30) as page:
            text = page.read().decode()
        pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
        return sum(float(value) for value in pattern.findall(text))

    def kernels(self) -> list[str]:
        """The vLLM kernel libraries its processes loaded (`probe`)."""
        found: set[str] = set()
        for path in self.probe_dir.glob("*.json"):
            found.update(json.loads(path.read_text()).get("kernels", []))
        return sorted(found)

    def processes(self) -> list[dict]:
        """Where each of its processes last ran (`probe.placement`)."""
        return [
            json.loads(path.read_text()).get("placement")
            for path in sorted(self.probe_dir.glob("*.json"))
        ]

    def decisions(self) -> list[str]:
        """The decisions this package's log lines name, one per process."""
        return re.findall(
            r"vllm-kvfill-patch (\w+) for vLLM", self.log.read_text(errors="replace")
        )


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


BURST_SECONDS = 1e-4
"""Two streamed chunks of a request that vLLM's client timed this close were
read at once: they had waited for it in a buffer."""


def read_in_bursts(result: dict) -> int:
    """Requests of a `vllm bench serve` result (saved with `--save-detailed`)
    whose tokens its client read mostly in bursts: over half their
    inter-token latencies under `BURST_SECONDS`. Their TPOT and ITL are not
    the server's (a whole output read at once times as TPOT 0): the client
    or the API server was kept off the CPU while the engine went on. On two
    cores this happens: vLLM's engine core spin-waits on its worker."""
    return sum(
        1
        for itls in result.get("itls", [])
        if itls and 2 * sum(itl < BURST_SECONDS for itl in itls) > len(itls)
    )


def client_error(result: dict) -> str | None:
    """The exception vLLM's client ended its first failed request with (the
    last line of its traceback), from a result saved with `--save-detailed`."""
    for error in result.get("errors", []):
        if error and error.strip():
            return error.strip().splitlines()[-1]
    return None


def bench(
    server: Server,
    model: str,
    tokenizer: str,
    concurrency: int,
    prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    result: Path,
    extra: list[str],
) -> dict:
    """One run of vLLM's own `vllm bench serve` against `server` (its code,
    in this process: a new interpreter would import vLLM again every run);
    its result JSON (with each request's timings and error), also left at
    `result`, its output beside it."""
    from vllm.benchmarks.serve import add_cli_args, main

    arguments = [
        "--backend", "vllm", "--base-url", server.base_url,
        "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--ignore-eos",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--seed", str(seed), "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name, *extra,
    ]  # fmt: skip
    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    log = result.with_suffix(".log")
    with log.open("w") as out, contextlib.redirect_stdout(out):
        try:
            main(parser.parse_args(arguments))
        except Exception as error:  # a cell of the table says it
            raise RuntimeError(
                f"vllm bench serve failed: {type(error).__name__}: {error}"
            ) from error
    return json.loads(result.read_text())


PERCENTILE_KEY = re.compile(r"p(\d+(?:\.\d+)?)_(ttft|tpot|itl)_ms")
"""How vLLM's result names a percentile of a metric: `p99_itl_ms`."""


def request_seconds(result: dict) -> dict[str, list[float]]:
    """A run's samples of each metric vLLM takes percentiles of, in seconds,
    as `calculate_metrics` in vllm/benchmarks/serve.py takes them: a TTFT per
    request, a TPOT per request of more than one output token, every ITL."""
    seconds: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": []}
    for ttft, latency, length, itls in zip(
        result["ttfts"], result["latencies"], result["output_lens"],
        result["itls"], strict=True,
    ):  # fmt: skip
        seconds["ttft"].append(ttft)
        seconds["itl"] += itls
        if length > 1:
            seconds["tpot"].append((latency - ttft) / (length - 1))
    return seconds


def combined(results: list[dict]) -> dict:
    """The figures of runs of `vllm bench serve` (saved with
    `--save-detailed`, every request completed) taken as one run: vLLM's
    own formulas (`calculate_metrics` in vllm/benchmarks/serve.py) over all
    their requests, their durations added; the lists stay in vLLM's files.
    For one run, its own figures again (to float rounding)."""
    import numpy as np

    figures = {k: v for k, v in results[0].items() if not isinstance(v, list)}
    for key in (
        "num_prompts", "completed", "failed", "duration",
        "total_input_tokens", "total_output_tokens",
    ):  # fmt: skip
        figures[key] = sum(result[key] for result in results)
    for key in ("max_output_tokens_per_s", "max_concurrent_requests"):
        figures[key] = max(result[key] for result in results)
    duration = figures["duration"]
    tokens = figures["total_input_tokens"] + figures["total_output_tokens"]
    figures.update(
        request_throughput=figures["completed"] / duration,
        output_throughput=figures["total_output_tokens"] / duration,
        total_token_throughput=tokens / duration,
    )
    seconds: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": []}
    for result in results:
        for metric, values in request_seconds(result).items():
            seconds[metric] += values
    for metric, values in seconds.items():
        taken = values or [0.0]
        figures[f"mean_{metric}_ms"] = float(np.mean(taken)) * 1000
        figures[f"median_{metric}_ms"] = float(np.median(taken)) * 1000
        figures[f"std_{metric}_ms"] = float(np.std(taken)) * 1000
    for key in list(figures):
        if match := PERCENTILE_KEY.fullmatch(key):
            percentile, metric = float(match[1]), match[2]
            taken = seconds[metric] or [0.0]
            figures[key] = float(np.percentile(taken, percentile)) * 1000
    return figures
