"""patches/: each file applies to its release's real connector file and
behaves exactly like the overlay (the same behaviour tests, run on it).

Run in the sessions of releases that have a patch file (see noxfile.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests import children
from tests.helpers import CONNECTOR_PATH, ROOT, git_apply, run_fresh
from vllm_kvfill_patch.releases import parse_release


def test_patch_is_a_format_patch_of_the_connector_only(patch_file):
    text = patch_file.read_text()
    assert re.match(r"From [0-9a-f]{40} ", text)
    for header in ("\nFrom: ", "\nDate: ", "\nSubject: [PATCH] "):
        assert header in text
    touched = re.findall(r"^diff --git a/(\S+) b/", text, re.MULTILINE)
    assert touched == [CONNECTOR_PATH.as_posix()]
    if parse_release(patch_file.name.rpartition("-v")[2][:-6]) < (0, 24, 0):
        assert "'list' object has no attribute 'device'" in text
    else:
        assert "(#45080)" in text


def test_patch_applies_to_the_release_file(release_tree, patch_file):
    result = git_apply(release_tree, patch_file, "--check")
    assert result.returncode == 0, result.stderr


BEHAVIOUR_TESTS = ["tests/test_connector.py", "tests/test_refill.py"]


def behaviour_selection(vllm_version: str) -> str:
    """The behaviour tests a patch for `vllm_version` must pass.

    FlashAttention's (2, num_blocks, ...) layout is gone from 0.23 on.
    """
    if parse_release(vllm_version) < (0, 30, 0):
        return "behaviour"
    return "behaviour and not kv_first_layout"


def behaviour_test_ids(selection: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", selection]
        + BEHAVIOUR_TESTS,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_patched_file_passes_the_same_behaviour_tests(patched_connector, vllm_version):
    selection = behaviour_selection(vllm_version)
    expected = behaviour_test_ids(selection)
    assert len(expected) >= 14
    env = {**os.environ, "KVFILL_CONNECTOR_FILE": str(patched_connector)}
    command = [sys.executable, "-m", "pytest", "-q", "-m", selection, *BEHAVIOUR_TESTS]
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


def test_overlay_stays_out_of_a_patched_connector(patched_connector, vllm_version):
    report = run_fresh(children.patched_file_report, str(patched_connector))
    assert report["_fill_blocks"] == report["register_kv_caches"] == 0
    assert report["get_num_new_matched_tokens"] == 0
    # The probes find nothing to fix in the patched file; the release is
    # expected to need the patch, so the reason says why it stays out.
    assert report["status"] == {
        "decision": "inert",
        "version": vllm_version,
        "reason": "upstream fills only the requested rows, once per step, in "
        "place, and fills a preempted request again, although vLLM "
        f"{vllm_version} is expected to need the patch (a patched or fixed "
        "connector)",
        "parts": [],
    }
