"""patches/: each release's series applies in order to the release's real
connector file and behaves exactly like the overlay (the same behaviour
tests, run on it). Upstream's own gates on the series (vLLM's pre-commit
hooks, its connector tests after each commit) are tests/test_upstream.py.

Run in the sessions of releases that have a patch series (see noxfile.py).
"""

from __future__ import annotations

import re

from tests import children
from tests.helpers import (
    CONNECTOR_PATH,
    NOTHING_WRAPPED,
    ROOT,
    UPSTREAM_TEST_PATH,
    run_forked,
    run_fresh,
)
from tools.matrix import ALLOCATOR
from vllm_kvfill_patch.releases import parse_release


def test_each_patch_is_a_signed_off_format_patch_of_the_connector_and_its_tests(
    patch_series,
):
    count = len(patch_series)
    for number, patch in enumerate(patch_series, start=1):
        text = patch.read_text()
        assert re.match(r"From [0-9a-f]{40} ", text), patch.name
        numbering = f"PATCH {number}/{count}" if count > 1 else "PATCH"
        # A title prefix such as [Bugfix] follows, kept by git am -b.
        assert f"\nSubject: [{numbering}] [" in text, patch.name
        assert re.search(r"^Signed-off-by: .+ <.+>$", text, re.MULTILINE), patch.name
        touched = re.findall(r"^diff --git a/(\S+) b/", text, re.MULTILINE)
        assert CONNECTOR_PATH.as_posix() in touched, patch.name
        assert set(touched) <= {CONNECTOR_PATH.as_posix(), UPSTREAM_TEST_PATH}


def behaviour_tests(vllm_version: str) -> list[str]:
    """The modules whose ``behaviour`` tests a patch series must pass."""
    modules = ["tests/test_connector.py", "tests/test_refill.py"]
    if parse_release(vllm_version) >= ALLOCATOR:
        modules.append("tests/test_allocator.py")
    return modules


def behaviour_selection(vllm_version: str) -> str:
    """The behaviour tests a patch for `vllm_version` must pass.

    FlashAttention's (2, num_blocks, ...) layout is gone from 0.23 on.
    """
    if parse_release(vllm_version) < (0, 30, 0):
        return "behaviour"
    return "behaviour and not kv_first_layout"


def test_patched_file_passes_the_same_behaviour_tests(patched_connector, vllm_version):
    # A pytest of its own, in a child of the zygote (no third-party imports
    # again), whose conftest loads the patched file in place of the release's.
    arguments = ["-q", "-m", behaviour_selection(vllm_version)]
    env = {"KVFILL_CONNECTOR_FILE": str(patched_connector)}
    exitcode, result, stdout, stderr = run_forked(
        children.pytest_in,
        (str(ROOT), [*arguments, *behaviour_tests(vllm_version)]),
        env,
        timeout=600,
    )
    assert exitcode == 0 and result["exitcode"] == 0, stdout[-8000:] + stderr[-2000:]
    # Every test the selection picked passed: none failed, errored or skipped.
    summary = stdout.strip().splitlines()[-1]
    outcomes = {kind: int(n) for n, kind in re.findall(r"(\d+) ([a-z]+)", summary)}
    assert set(outcomes) <= {"passed", "deselected", "warning", "warnings"}, summary
    assert outcomes.get("passed", 0) >= 14, summary


def test_overlay_stays_out_of_a_patched_connector(patched_connector, vllm_version):
    report = run_fresh(children.patched_file_report, str(patched_connector))
    assert report["wrappers"] == NOTHING_WRAPPED
    # The probes find nothing to fix in the patched file; the release is
    # expected to need the patch, so the reason says why it stays out.
    assert report["status"] == {
        "decision": "inert",
        "version": vllm_version,
        "reason": "upstream fills only the requested rows, once per step, in "
        "place, each request once, and the blocks after a prefix-cache hit, "
        "although vLLM "
        f"{vllm_version} is expected to need the patch (a patched or fixed "
        "connector)",
        "parts": [],
    }
