"""The prepared GPU check runs, here on the CPU, so it cannot rot.

``tools/gpu_check.py`` is the one command a CUDA machine
runs (see TESTING.md); on the CPU it checks the same bytes and reports that
the CUDA-only checks were not made.
"""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_the_gpu_check_runs_on_the_cpu_and_finds_the_bytes_right():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "gpu_check.py"),
            "--device",
            "cpu",
            "--quick",
            "--repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # Five cases, each with scattered blocks and with one run of them.
    assert len([line for line in lines if line.startswith("bytes ")]) == 10
    assert all(" ok (" in line for line in lines if line.startswith("bytes "))
    assert "sync   not a CUDA device: 7 cases ran, not checked" in lines
    assert lines[-1] == "result: ok"
    # The timing table: one row per request count, its far pages right.
    rows = [line.split(" | ") for line in lines if line.startswith("| 1")]
    assert [(row[0], row[-1]) for row in rows] == [("| 1", "ok |"), ("| 16", "ok |")]
