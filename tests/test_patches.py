"""patches/: each file applies to its release's real connector file and
behaves exactly like the overlay (the same behaviour tests, run on it).

Run in the sessions of releases that have a patch file (see noxfile.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import CONNECTOR_PATH, ROOT, git_apply, run_fresh
from vllm_kvfill_patch.gating import parse_release


def test_patch_is_a_format_patch_of_the_connector_only(patch_file):
    text = patch_file.read_text()
    assert re.match(r"From [0-9a-f]{40} ", text)
    for header in ("\nFrom: ", "\nDate: ", "\nSubject: [PATCH] "):
        assert header in text
    touched = re.findall(r"^diff --git a/(\S+) b/", text, re.MULTILINE)
    assert touched == [CONNECTOR_PATH.as_posix()]
    assert "'list' object has no attribute 'device'" in text or "whole" in text


def test_patch_applies_to_the_release_file(release_tree, patch_file):
    result = git_apply(release_tree, patch_file, "--check")
    assert result.returncode == 0, result.stderr


def behaviour_selection(vllm_version: str) -> str:
    """The behaviour tests a patch for `vllm_version` must pass.

    FlashAttention's (2, num_blocks, ...) layout is gone from 0.23 on, and
    the forward patch (0.33) leaves attention layouts to upstream.
    """
    if parse_release(vllm_version) < (0, 30, 0):
        return "behaviour"
    return "behaviour and not kv_first_layout"


def behaviour_test_ids(selection: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", selection],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_patched_file_passes_the_same_behaviour_tests(patched_connector, vllm_version):
    selection = behaviour_selection(vllm_version)
    expected = behaviour_test_ids(selection)
    assert len(expected) >= 9
    env = {**os.environ, "KVFILL_CONNECTOR_FILE": str(patched_connector)}
    command = [sys.executable, "-m", "pytest", "-q", "-m", selection]
    result = subprocess.run(
        [*command, "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-8000:]
    assert f"{len(expected)} passed" in result.stdout


def test_overlay_stays_out_of_a_patched_connector(patched_connector):
    # Loading the original first patches it; what counts is the decision
    # on the patched file, re-taken by apply() once it is in place.
    code = f"""
import json, wrapt
import vllm_kvfill_patch
from tests.conftest import load_connector_file
vllm_kvfill_patch.revert()
module = load_connector_file(r"{patched_connector}")
status = vllm_kvfill_patch.apply()
chain = wrapt.wrapper_chain(module.DecodeBenchConnectorWorker.__dict__["_fill_blocks"])
print(json.dumps({{"decision": status.decision.value, "reason": status.reason,
                  "wrappers": len(list(chain)) - 1}}))
"""
    report = run_fresh(code)
    assert report["wrappers"] == 0
    assert report["decision"] in ("inert", "refused")
    assert "per-group" in report["reason"]
