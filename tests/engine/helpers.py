"""Running engine_probe.main and reading its report; `vllm serve` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from tests.engine import engine_probe
from tests.engine.trace import Trace, decisions
from tests.helpers import ROOT, run_forked


def run_probe(
    options: dict, env: dict | None = None, timeout: float = 400, may_die: bool = False
) -> dict:
    """engine_probe.main's report, from a child of the zygote, with its output
    under "log" and its exit code under "returncode". With `may_die`, a probe
    that exits non-zero (an engine dying in vLLM's kernels) gives those two
    alone instead of failing the test."""
    env = dict(env or {})
    # Every process the engine starts imports engine_probe (worker_report).
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [env.get("PYTHONPATH", os.environ.get("PYTHONPATH")), str(ROOT)])
    )
    exitcode, report, stdout, stderr = run_forked(
        engine_probe.main, (options,), env, timeout
    )
    finished = exitcode == 0 and report is not None
    assert finished or may_die, f"{stdout[-3000:]}\n{stderr[-5000:]}"
    report = report if finished else {}
    report["returncode"] = exitcode
    report["log"] = stdout + stderr
    return report


def check_every_step_filled_exactly_its_blocks(fills: list, requests: int) -> None:
    """Each step: every layer of a group got all of that group's requested
    blocks, and nothing changed outside the step's requested blocks (the
    pools are shared: a page written through one group's layer shows in the
    other group's view at the same row)."""
    assert sum(fill["requests"] for fill in fills) == requests
    for fill in fills:
        requested = {b for ids in fill["block_ids_by_group"].values() for b in ids}
        requested.discard(0)
        changed = set()
        for rows in fill["changed_rows"].values():
            assert set(rows) <= requested
            changed |= set(rows)
        assert changed == requested
        for group, layers in fill["layers_by_group"].items():
            wanted = set(fill["block_ids_by_group"][group]) - {0}
            for layer in layers:
                assert wanted <= set(fill["changed_rows"][layer]), (group, layer)
        assert fill["filled_values_ok"]


def check_processes(trace: Trace, log: str, decision: str) -> dict[int, str]:
    """Every process that built a DecodeBenchConnector (a scheduler or a
    worker: where it runs) logged the patch's decision, and it is `decision`;
    returns the decisions by pid. Other processes import the connector's
    module without running it (the `vllm serve` launcher and vLLM's
    model-inspection subprocess, which load no plugins or keep their output):
    counted, not required."""
    logged = decisions(log)
    builders = trace.pids("built")
    assert builders, "no process built a DecodeBenchConnector"
    assert builders <= set(logged), (builders, logged)
    assert {logged[pid] for pid in builders} == {decision}
    print(
        f"{len(trace.pids('start'))} processes started, "
        f"{len(trace.pids('connector'))} imported the connector, "
        f"{len(builders)} built it ({sorted(trace.roles().items())}), "
        f"{len(logged)} logged the patch's decision"
    )
    return logged


def check_worker_fills(trace: Trace, pid: int) -> int:
    """A worker's fills: each step wrote exactly its requests' blocks; the
    number of requests it filled."""
    fills = [dict(e) for e in trace.of(pid, "fill")]
    total = sum(fill["requests"] for fill in fills)
    check_every_step_filled_exactly_its_blocks(fills, requests=total)
    return total


def resumptions(steps: list[dict]) -> list[dict]:
    """Each resumption of a request vLLM had preempted: its tokens then, those
    it had computed before (a prefix-cache hit, or what the connector
    matched) and those computed to catch up with them, over as many steps
    as vLLM took (a hybrid model's prefill stops at block boundaries)."""
    found: list[dict] = []
    catching_up: dict[str, dict] = {}
    waiting: set[str] = set()
    for step in steps:
        for request_id, tokens in step["scheduled"].items():
            before = step["computed_before"][request_id]
            if request_id in waiting:
                waiting.discard(request_id)
                resumed = {"tokens": step["tokens"][request_id], "before": before}
                catching_up[request_id] = resumed | {"computed": 0}
                found.append(catching_up[request_id])
            resumption = catching_up.get(request_id)
            if resumption is not None:
                resumption["computed"] += tokens
                if before + tokens >= resumption["tokens"]:
                    del catching_up[request_id]
        waiting.update(step["preempted"])
        for request_id in step["preempted"]:
            catching_up.pop(request_id, None)
    return found


def admissions(steps: list[dict]) -> dict[str, list[int]]:
    """Per request, the tokens computed in the step that admitted it and in
    each step that resumed it after a preemption."""
    admitted: dict[str, list[int]] = {}
    waiting: set[str] = set()
    for step in steps:
        waiting.update(step["preempted"])
        for request_id, tokens in step["scheduled"].items():
            if request_id not in admitted or request_id in waiting:
                admitted.setdefault(request_id, []).append(tokens)
                waiting.discard(request_id)
    return admitted


SHARED_PREFIX = {"prefix": 256, "prompt": 500, "requests": 2}
"""Two prompts of a dense model (``engine_probe.write_tiny_dense_model``)
sharing their first 256 tokens, admitted one after the other."""


def check_a_prefix_hit_fills_only_after_it(report: dict) -> None:
    assert report["generated"] == [6, 6]
    fills = report["fills"]
    check_every_step_filled_exactly_its_blocks(fills, requests=2)
    first, second = (
        ids for fill in fills for ids in fill["block_ids_by_group"].values()
    )
    # The second hit the cache (fewer blocks to fill) and filled none of the
    # blocks holding the shared prefix: the first request's first blocks (a
    # fresh pool hands them out in order). Its other blocks were freed when it
    # finished and may be handed out again.
    hit = len(first) - len(second)
    assert hit > 0 and second
    assert not set(second) & set(first[:hit])


def serve_command(
    model: Path, *arguments: str, connector_options: dict | None = None
) -> list[str]:
    """`vllm serve` of a tiny model (dummy weights, no tokenizer) through
    DecodeBenchConnector (with `connector_options` as its extra config),
    with `arguments` added."""
    connector: dict = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}
    if connector_options:
        connector["kv_connector_extra_config"] = connector_options
    return [
        str(Path(sys.executable).with_name("vllm")), "serve", str(model),
        "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", "256",
        "--enforce-eager", "--dtype", "bfloat16",
        "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
        "--kv-transfer-config", json.dumps(connector), *arguments,
    ]  # fmt: skip


@contextmanager
def running(
    commands: list[tuple[list[str], dict, Path]],
) -> Iterator[list[subprocess.Popen]]:
    """Each `(command, env, log)` running (`env` added to this process's),
    its output in `log`; all terminated on the way out."""
    servers = []
    try:
        for command, env, log in commands:
            with log.open("w") as out:
                servers.append(
                    subprocess.Popen(
                        command,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env={**os.environ, **env},
                    )
                )
        yield servers
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()


def wait_until_healthy(
    base: str, servers: list[subprocess.Popen], logs: list[Path], timeout: float = 300
) -> None:
    """Until `base`/health answers 200; fails with a server's log if it
    exits, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for server, log in zip(servers, logs, strict=True):
            assert server.poll() is None, log.read_text()[-5000:]
        assert time.monotonic() < deadline, "server did not come up"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)


def complete(base: str, model: Path, prompt: list[int], max_tokens: int) -> dict:
    """One completion over HTTP (token ids in, no tokenizer needed)."""
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{base}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200
        return json.load(response)


def send_all(base: str, model: Path, count: int, prompt: int, output: int) -> list:
    """`count` concurrent completions of `prompt` tokens; their token counts."""
    prompts = [[1 + (seed + i) % 500 for i in range(prompt)] for seed in range(count)]
    with ThreadPoolExecutor(count) as pool:
        done = pool.map(lambda p: complete(base, model, p, output), prompts)
        return [c["usage"]["completion_tokens"] for c in done]
