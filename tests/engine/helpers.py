"""Running engine_probe.main and reading its report."""

from __future__ import annotations

import os

from tests.engine import engine_probe
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
