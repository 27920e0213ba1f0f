"""The prepared GPU check runs, here on the CPU, so it cannot rot.

``tools/gpu_check.py`` is the one command a CUDA machine
runs (see TESTING.md), where there is no vLLM; here it runs the same way,
with vLLM hidden, checks every path's bytes and reports that the CUDA-only
checks were not made. A fill that writes one row too many
(``tests/gpu_check_mutant.py``) fails it on every path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

PATHS = 22
"""Every path the worker's step can take (``gpu_check.PATHS``)."""


@pytest.fixture
def without_vllm(tmp_path):
    """The environment of a bare GPU machine: importing vLLM fails."""
    hidden = tmp_path / "vllm"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('hidden, as on a bare GPU')")
    return {**os.environ, "PYTHONPATH": str(tmp_path)}


def run(script: str, arguments: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / script), "--device", "cpu", "--quick", *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


def path_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("bytes ")]


def test_the_gpu_check_runs_every_path_on_the_cpu_without_vllm(without_vllm, tmp_path):
    table = tmp_path / "gpu_check.md"
    result = run(
        "tools/gpu_check.py", ["--repeats", "2", "--table", str(table)], without_vllm
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    paths = path_lines(result.stdout)
    assert len(paths) == PATHS, paths
    assert all(line.endswith("constant ok  random ok") for line in paths), paths
    assert any("list states + attention, shared pool" in line for line in paths)
    assert lines[-1].startswith("result: ok in ")
    assert any(line.startswith("cuda   not a CUDA device") for line in lines)
    # The package's worker step ran (its warning, through Python's logging):
    # int8 state pages cannot hold the constant.
    assert "KV-cache group 0 has integer caches (torch.int8; 4 layers" in (
        result.stderr
    )
    # The timing table: one row per request count, its far pages right.
    rows = [line.split(" | ") for line in lines if line.startswith("| 1")]
    assert [(row[0], row[-1]) for row in rows] == [("| 1", "ok |"), ("| 16", "ok |")]
    written = table.read_text()
    assert written.count("| ok | ok |") == PATHS, written
    assert "| 16 | " in written


def test_a_fill_that_writes_one_row_too_many_fails_the_check_on_every_path(
    without_vllm,
):
    result = run(
        "tests/gpu_check_mutant.py",
        ["--repeats", "1", "--requests", "1"],
        without_vllm,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    paths = path_lines(result.stdout)
    assert len(paths) == PATHS, result.stdout + result.stderr
    for line in paths:
        assert "constant WRONG (bytes outside the requested rows moved" in line
        assert "random WRONG (bytes outside the requested rows moved" in line
    assert result.stdout.splitlines()[-1].startswith("result: FAILED")
