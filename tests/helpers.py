"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from tests import children, zygote
from tests.children import CONNECTOR_MODULE

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

CONNECTOR_PATH = Path(*CONNECTOR_MODULE.split(".")).with_suffix(".py")
UPSTREAM_TEST_PATH = "tests/v1/kv_connector/unit/test_decode_bench_connector.py"
"""Upstream's own tests of the connector, in vLLM's source tree (the
package is not imported here before the zygote starts: tools/matrix.py's
copy is checked against these by tests/test_policy.py)."""
BUILD_COMMAND = "python3 -m nox  (see TESTING.md)"


def run_fresh(
    function: Callable, *args, env: dict | None = None, cwd: Path | None = None
) -> dict:
    """Run `function` (from tests/children.py) in a fresh process.

    A child of the zygote (run_forked); with `cwd` (a directory outside the
    checkout), a cold interpreter instead, whose sys.path holds neither the
    checkout nor what pytest added. Returns the function's JSON report, with
    the child's output under "stdout" and "stderr" (vLLM logs to stdout).
    """
    if cwd is not None:
        return _run_cold(function, args, env, cwd)
    exitcode, report, stdout, stderr = run_forked(function, args, env or {})
    assert exitcode == 0 and report is not None, (
        f"child failed ({exitcode}):\n{stdout}\n{stderr}"
    )
    report["stdout"], report["stderr"] = stdout, stderr
    return report


def run_forked(
    function: Callable, args: tuple, env: dict, timeout: float = 300
) -> tuple[int, dict | None, str, str]:
    """`function(*args)` in a child forked from the zygote (tests/zygote.py),
    under `env` (its PYTHONPATH leading sys.path, as in a new interpreter).

    Returns the child's exit code (-9: killed after `timeout` seconds), the
    function's JSON report (None if it returned none), its stdout and stderr.
    """
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        exitcode = zygote.run(_child_main, (function, args, env, str(out)), timeout)
        result = out / "result.json"
        report = json.loads(result.read_text()) if result.exists() else None
        return exitcode, report, *((out / n).read_text() for n in ("stdout", "stderr"))


def _child_main(function: Callable, args: tuple, env: dict, out: str) -> None:
    """In the forked child: output to files, env applied, then the scenario."""
    loaded = [m for m in zygote.NEVER_PRELOADED if m in sys.modules]
    assert not loaded, f"the zygote has loaded {loaded}"
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        with open(os.path.join(out, stream), "w") as file:
            os.dup2(file.fileno(), fd)
    # pytest may have had its capture files there when it forked the zygote
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    os.environ.update(env)
    sys.path[:0] = filter(None, env.get("PYTHONPATH", "").split(os.pathsep))
    try:
        result = function(*args)
        with open(os.path.join(out, "result.json"), "w") as file:
            json.dump(result, file)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _run_cold(function: Callable, args: tuple, env: dict | None, cwd: Path) -> dict:
    result = subprocess.run(
        [sys.executable, str(TESTS / "fresh.py"), function.__name__, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
        cwd=cwd,
    )
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, (
        f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    report = json.loads(lines[-1])
    report["stdout"], report["stderr"] = result.stdout, result.stderr
    return report


def status_command(cwd: Path | None = None) -> str:
    """What `python -m vllm_kvfill_patch` prints, in a fresh process: that
    command in a cold interpreter started in `cwd`; without `cwd`, its
    __main__ run in a child of the zygote (1 s against 9 s here)."""
    if cwd is None:
        report = run_fresh(children.status_command)
        assert report["exitcode"] in (0, None), report["stderr"][-5000:]
        return report["stdout"]
    result = subprocess.run(
        [sys.executable, "-m", "vllm_kvfill_patch"],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stdout


def patches_by_release() -> dict[str, list[Path]]:
    from tools.matrix import patches_by_release as by_release

    return by_release(ROOT / "patches")


def git_apply(tree: Path, patch: Path) -> subprocess.CompletedProcess:
    """`git apply` the connector's part of `patch` in `tree` (a series also
    changes upstream's test file, which a connector-only tree lacks)."""
    include = f"--include={CONNECTOR_PATH.as_posix()}"
    return subprocess.run(
        ["git", "apply", include, str(patch)], cwd=tree, capture_output=True, text=True
    )


DECODE_NODE_DEFAULT = (
    "a decode node's: each request filled once, a preempted request recomputed "
    "(the refill is opt-in: refill_preempted in the connector's options)"
)
"""The semantics in force by default, and why (``PatchStatus.semantics`` and
``semantics_why``, as the status reason ends)."""


def applied_defects(vllm_version: str) -> str:
    """What the release policy expects the probes of upstream's own methods to
    find on this release (``PatchStatus.defects``)."""
    from vllm_kvfill_patch.releases import DEFECTS, policy_for

    return "; ".join(DEFECTS[defect] for defect in policy_for(vllm_version).defects)


def applied_reason(vllm_version: str, semantics: str = DECODE_NODE_DEFAULT) -> str:
    """The status reason the release policy expects on this release: the
    defects, then the semantics in force and why."""
    return f"{applied_defects(vllm_version)}; semantics: {semantics}"


def applied_parts(vllm_version: str, refill: bool = False) -> list[str]:
    """The parts of the patch the policy's defects call for (``PatchStatus.parts``),
    the link's metrics (every applied release has the stats API and a
    synchronous connector), with the opt-in refill where asked."""
    from vllm_kvfill_patch.releases import policy_for

    defects = set(policy_for(vllm_version).defects)
    parts = {
        "fill": bool(defects - {"zero_token_fill", "hit_blocks"}),
        "fill-once": "zero_token_fill" in defects,
        "prefix-hit": "hit_blocks" in defects,
        "options": True,
        "link-metrics": True,
        "refill": refill,
    }
    return [part for part, needed in parts.items() if needed]


NOTHING_WRAPPED = dict.fromkeys(children.CONNECTOR_METHODS, 0)
"""A child's ``report["wrappers"]`` where the patch is out."""


def wrappers_for(parts: list[str]) -> dict[str, int]:
    """A child's ``report["wrappers"]`` where these parts of the patch are in:
    one wrapper on the connector's step (fill), on its ``__init__``
    (options), on the scheduler side's ``update_state_after_alloc``
    (fill-once) and ``get_num_new_matched_tokens`` (refill), on the
    connector's ``update_state_after_alloc`` (prefix-hit); none on the
    worker's methods."""
    return {
        **NOTHING_WRAPPED,
        "DecodeBenchConnector.start_load_kv": int("fill" in parts),
        "DecodeBenchConnector.__init__": int("options" in parts),
        "DecodeBenchConnectorScheduler.update_state_after_alloc": int(
            "fill-once" in parts
        ),
        "DecodeBenchConnectorScheduler.get_num_new_matched_tokens": int(
            "refill" in parts
        ),
        "DecodeBenchConnector.update_state_after_alloc": int("prefix-hit" in parts),
    }


def decision_lines(report: dict, decision: str) -> int:
    """How often a child logged ``vllm-kvfill-patch <decision> for vLLM <v>
    (hot-fix <this package's version>)``, wherever vLLM's own lines went:
    stdout once vLLM has configured its logging (up to 0.30 at import; from
    0.31 when an engine or the CLI starts), else stderr, through Python's
    last-resort handler, which passes warnings only."""
    output = report["stdout"] + report["stderr"]
    ours = re.escape(metadata.version("vllm-kvfill-patch"))
    line = rf"vllm-kvfill-patch {decision} for vLLM \S+ \(hot-fix {ours}\): "
    return len(re.findall(line, output))


@contextlib.contextmanager
def opt_ins_forgotten():
    """Inside the block a connector may ask for the refill or the link model;
    after it, this process's patch is as if none had (the installer keeps
    what was asked)."""
    import vllm_kvfill_patch
    from vllm_kvfill_patch import Decision, installer

    try:
        yield
    finally:
        if vllm_kvfill_patch.status().decision is Decision.APPLIED:
            installer._installer.refill_source = ""
            installer._installer.link_model = None
            vllm_kvfill_patch.revert()
            assert vllm_kvfill_patch.apply().decision is Decision.APPLIED


@contextlib.contextmanager
def overlay_reverted():
    """Upstream's own methods inside the block; the overlay applied again after."""
    import vllm_kvfill_patch
    from vllm_kvfill_patch import Decision

    vllm_kvfill_patch.revert()
    try:
        yield
    finally:
        assert vllm_kvfill_patch.apply().decision is Decision.APPLIED
