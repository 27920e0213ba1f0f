"""The prepared GPU check runs, here on the CPU, so it cannot rot.

``tools/gpu_check.py`` is the one command a CUDA machine
runs (see TESTING.md), where there is no vLLM; here it runs the same way,
with vLLM hidden, checks the same bytes and reports that the CUDA-only
checks were not made.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import ROOT


def test_the_gpu_check_runs_on_the_cpu_without_vllm_and_finds_the_bytes_right(
    tmp_path,
):
    hidden = tmp_path / "vllm"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('hidden, as on a bare GPU')")
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
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    # Five cases, each with scattered blocks and with one run of them.
    assert len([line for line in lines if line.startswith("bytes ")]) == 10
    assert all(" ok (" in line for line in lines if line.startswith("bytes "))
    assert "sync   not a CUDA device: 7 cases ran, not checked" in lines
    assert lines[-1] == "result: ok"
    # The package's worker step ran (its warning, through Python's logging):
    # int8 state pages cannot hold the constant.
    assert "KV-cache group 0 has integer caches (torch.int8; 12 layers" in (
        result.stderr
    )
    # The timing table: one row per request count, its far pages right.
    rows = [line.split(" | ") for line in lines if line.startswith("| 1")]
    assert [(row[0], row[-1]) for row in rows] == [("| 1", "ok |"), ("| 16", "ok |")]
