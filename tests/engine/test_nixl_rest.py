"""`fidelity.nixl_rest` on a real NIXL agent (the engine's nixl wheel): the
rest is read back from what the agent's progress thread does, not from the
tool's constant. Without it the thread polls without rest, a core's worth
of CPU; with it, the thread sleeps between polls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT
from vllm_kvfill_patch.fidelity.cores import stat_fields
from vllm_kvfill_patch.fidelity.wire import DIR_ENV, NIXL_REST_ENV, NIXL_THREADS

WATCHED_S = 1.0


def progress_cpu(directory: str) -> None:
    """In a fresh interpreter: a NIXL agent with its progress thread and UCX,
    made after `nixl_rest.install()`; prints, as JSON, the CPU seconds each
    thread the agent started took over `WATCHED_S`, and the threads the
    rest recorded."""
    from vllm_kvfill_patch.fidelity import nixl_rest

    nixl_rest.install()
    from nixl._api import nixl_agent, nixl_agent_config

    before = set(os.listdir("/proc/self/task"))
    config = nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
    agent = nixl_agent("rested", config)
    started = set(os.listdir("/proc/self/task")) - before

    def cpu(thread: str) -> float:
        fields = stat_fields(int(thread))  # a thread's stat, read through its id
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    at_start = {thread: cpu(thread) for thread in started}
    time.sleep(WATCHED_S)
    used = {thread: cpu(thread) - at_start[thread] for thread in started}
    recorded = Path(directory, f"{os.getpid()}{NIXL_THREADS}")
    said = recorded.read_text().split() if recorded.exists() else []
    print(json.dumps({"cpu": used, "recorded": said}))
    del agent


def run(tmp_path: Path, rest_us: str | None) -> dict:
    env = {**os.environ, DIR_ENV: str(tmp_path), "UCX_TLS": "tcp,self"}
    env.pop(NIXL_REST_ENV, None)
    if rest_us is not None:
        env[NIXL_REST_ENV] = rest_us
    code = (
        "import sys; from tests.engine.test_nixl_rest import progress_cpu; "
        "progress_cpu(sys.argv[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("rest_us", [None, "100"], ids=["unrested", "rested"])
def test_the_progress_thread_polls_without_rest_unless_the_tool_rests_it(
    tmp_path, rest_us
):
    found = run(tmp_path, rest_us)
    busiest = max(found["cpu"].values())
    if rest_us is None:
        assert busiest > 0.5 * WATCHED_S, found  # a core's worth, spinning
        assert not found["recorded"]
        return
    assert busiest < 0.2 * WATCHED_S, found
    # What it records for the tool to keep at the worker's priority are
    # threads of the agent (the bound agent's own; UCX's start after it).
    assert set(found["recorded"]) <= set(found["cpu"]), found
