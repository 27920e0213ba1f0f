"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests import children
from tests.children import CONNECTOR_MODULE

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

CONNECTOR_PATH = Path(*CONNECTOR_MODULE.split(".")).with_suffix(".py")
BUILD_COMMAND = "python3 -m nox  (see README.md, 'Running the tests')"


PRELOADED = [
    "torch",
    "torch._dynamo",
    "torch._inductor.lowering",
    "torch._inductor.compile_fx",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",
    "transformers.models.auto",
    "transformers.modeling_gguf_pytorch_utils",
    "openai",
    "aiohttp",
    "pydantic",
    "fastapi",
    "xgrammar",
    "setuptools",
    "requests",
    "zmq",
    "prometheus_client",
    "psutil",
    "msgspec",
    "tokenizers",
]
"""What the fork server imports once: the third-party modules that are most
of vLLM's import time (a child then imports the connector in 1 s, not 8 s).
Never vLLM, wrapt or this package, whose import order is what the scenarios
are about (each child checks). One a release lacks is skipped."""
NEVER_PRELOADED = ("vllm", "wrapt", "vllm_kvfill_patch")


def run_fresh(
    function: Callable, *args, env: dict | None = None, cwd: Path | None = None
) -> dict:
    """Run `function` (from tests/children.py) in a fresh process.

    Forked from a fork server that imported only PRELOADED; with `cwd` (a
    directory outside the checkout), a cold interpreter instead, whose
    sys.path holds neither the checkout nor what pytest added. Returns the
    function's JSON report, with the child's output under "stdout" and
    "stderr" (vLLM logs to stdout).
    """
    if cwd is not None:
        return _run_cold(function, args, env, cwd)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        child = context.Process(
            target=_child_main, args=(function.__name__, args, env or {}, str(out))
        )
        child.start()
        child.join(300)
        stdout, stderr = (out / "stdout").read_text(), (out / "stderr").read_text()
        result = out / "result.json"
        assert child.exitcode == 0 and result.exists(), (
            f"child failed ({child.exitcode}):\n{stdout}\n{stderr}"
        )
        report = json.loads(result.read_text())
    report["stdout"], report["stderr"] = stdout, stderr
    return report


def _child_main(name: str, args: tuple, env: dict, out: str) -> None:
    """In the forked child: output to files, env applied, then the scenario."""
    loaded = [m for m in NEVER_PRELOADED if m in sys.modules]
    assert not loaded, f"the fork server has loaded {loaded}"
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        with open(os.path.join(out, stream), "w") as file:
            os.dup2(file.fileno(), fd)
    os.environ.update(env)
    from tests import children

    try:
        result = getattr(children, name)(*args)
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
    __main__ run in a fork-server child (1 s against 9 s here)."""
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


def patches_by_release() -> dict[str, Path]:
    from vllm_kvfill_patch.releases import patches_by_release as by_release

    return by_release(ROOT / "patches")


def git_apply(tree: Path, patch: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "apply", *options, str(patch)], cwd=tree, capture_output=True, text=True
    )


def applied_reason(vllm_version: str) -> str:
    """Why the patch applies to this release, as upstream's code behaves there:
    every release with the connector (0.11.1 - 0.33) has the last three."""
    from vllm_kvfill_patch.releases import parse_release

    if parse_release(vllm_version) < (0, 24, 0):
        states = "_fill_blocks crashes on list/tuple (Mamba) caches"
    else:
        states = "_fill_blocks fills list/tuple state tensors whole"
    return (
        f"{states}; a kernel-split attention cache gets kernel row b, not "
        "block b; each request's fill builds a temporary the size of its region; "
        "a preempted request is not filled again (vLLM prefills it)"
    )


def decision_lines(report: dict, decision: str) -> int:
    """How often a child logged ``vllm-kvfill-patch <decision>``, wherever
    vLLM's own lines went: stdout once vLLM has configured its logging (up
    to 0.30 at import; from 0.31 when an engine or the CLI starts), else
    stderr, through Python's last-resort handler, which passes warnings only."""
    output = report["stdout"] + report["stderr"]
    return output.count(f"vllm-kvfill-patch {decision}")


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
