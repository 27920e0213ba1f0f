"""tools/matrix.py and the package's policy are the one source of truth;
everything else follows them.

docs/releases.md's tables are generated from them, the nox matrix reads the matrix,
locks/ has a lock per environment it names, and every patch file targets a tested
release.
Each failure message names what to run or edit.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import noxfile
from tests.helpers import ROOT
from tools import matrix
from vllm_kvfill_patch.releases import SUPPORT_POLICY, parse_release, policy_for

RELEASES_PAGE = ROOT / "docs" / "releases.md"
TABLES = re.compile(r"<!-- releases:begin -->\n(.*?)\n<!-- releases:end -->", re.DOTALL)
REGENERATE = "python3 -m nox -s docs"
DIFFER = "docs/releases.md's tables differ from tools/matrix.py and the policy"
EDIT = (
    "edit tools/matrix.py (PUBLISHED, TESTED) or vllm_kvfill_patch/releases.py "
    "(SUPPORT_POLICY), then run " + REGENERATE
)


def drift(page_text: str, patch_releases: list[str], locks: set[str]) -> list[str]:
    """Every disagreement with tools/matrix.py, each naming its fix."""
    problems = []
    match = TABLES.search(page_text)
    if not match:
        problems.append("docs/releases.md has no <!-- releases:begin/end --> block")
    elif match[1] != matrix.release_tables(patch_releases):
        problems.append(f"{DIFFER}: {EDIT}")
    for release in sorted(set(matrix.TESTED) - locks):
        problems.append(
            f"matrix.TESTED has {release} but locks/connector-{release}.txt is "
            f"missing: python3 -m nox -s lock -- connector-{release}"
        )
    for release in sorted(locks - set(matrix.TESTED)):
        problems.append(
            f"locks/connector-{release}.txt locks a release that matrix.TESTED "
            "does not list: add it there or delete the lock"
        )
    for release in patch_releases:
        if release not in matrix.TESTED:
            problems.append(
                f"patches/ targets {release}, which matrix.TESTED does not list"
            )
        if release not in matrix.SOURCE_DISTRIBUTIONS:
            problems.append(
                f"patches/ targets {release}: add the sha256 of its source "
                "distribution to matrix.SOURCE_DISTRIBUTIONS"
            )
        if not (ROOT / "locks" / f"upstream-{release}.txt").exists():
            problems.append(
                f"patches/ targets {release} but locks/upstream-{release}.txt is "
                f"missing: python3 -m nox -s lock -- upstream-{release}"
            )
    return problems


def locked_releases() -> set[str]:
    return {
        p.stem.removeprefix("connector-") for p in (ROOT / "locks").glob("connector-*")
    }


def test_release_tables_locks_and_patches_follow_the_matrix():
    problems = drift(
        RELEASES_PAGE.read_text(), noxfile.patch_releases(), locked_releases()
    )
    assert not problems, "\n".join(problems)


def test_a_release_added_in_one_place_only_is_named_with_the_fix(monkeypatch):
    # A release in tools/matrix.py only: the tables and locks are behind.
    monkeypatch.setitem(matrix.TESTED, "0.35.0", "vllm")
    monkeypatch.setattr(matrix, "PUBLISHED", [*matrix.PUBLISHED, "0.35.0"])
    problems = drift(
        RELEASES_PAGE.read_text(), noxfile.patch_releases(), locked_releases()
    )
    assert problems == [
        f"{DIFFER}: {EDIT}",
        "matrix.TESTED has 0.35.0 but locks/connector-0.35.0.txt is missing: "
        "python3 -m nox -s lock -- connector-0.35.0",
    ]
    monkeypatch.undo()
    # A release in the tables only, and a lock and a patch without a release.
    page = RELEASES_PAGE.read_text().replace(
        "| 0.33.0 |", "| 0.35.0 | inert | tested: connector level |\n| 0.33.0 |"
    )
    problems = drift(page, ["0.35.0"], {*locked_releases(), "0.35.0"})
    assert problems == [
        f"{DIFFER}: {EDIT}",
        "locks/connector-0.35.0.txt locks a release that matrix.TESTED does not "
        "list: add it there or delete the lock",
        "patches/ targets 0.35.0, which matrix.TESTED does not list",
        "patches/ targets 0.35.0: add the sha256 of its source distribution to "
        "matrix.SOURCE_DISTRIBUTIONS",
        "patches/ targets 0.35.0 but locks/upstream-0.35.0.txt is missing: "
        "python3 -m nox -s lock -- upstream-0.35.0",
    ]


def test_nox_has_one_connector_session_per_tested_release():
    sessions = subprocess.run(
        [sys.executable, "-m", "nox", "--json", "-l", "-s", "connector"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = [session["call_spec"]["vllm"] for session in json.loads(sessions)]
    assert listed == list(matrix.TESTED)


NOT_TESTS = {"ci", "docs", "lock", "fidelity"}
NOT_TESTS |= {f"bench({v})" for v in noxfile.BENCH_RELEASES}
"""nox sessions that test nothing (the benchmarks measure, never assert; the
fidelity tool's test is tests/engine/test_fidelity.py, in engine(0.32.0))."""


def test_ci_runs_every_test_session_once():
    sessions = subprocess.run(
        [sys.executable, "-m", "nox", "--json", "-l", "-k", "ci or not ci"],  # all
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    defined = [session["session"] for session in json.loads(sessions)]
    run = noxfile.ci_sessions()
    assert len(run) == len(set(run))
    assert set(run) == set(defined) - NOT_TESTS


def test_policy_ranges_are_contiguous_and_cover_everything():
    assert SUPPORT_POLICY[0].first == (0, 0, 0) and SUPPORT_POLICY[-1].end is None
    for before, after in zip(SUPPORT_POLICY, SUPPORT_POLICY[1:], strict=False):
        assert before.end == after.first


def test_tested_releases_are_published_and_cover_every_connector_variant():
    assert set(matrix.TESTED) <= set(matrix.PUBLISHED)
    assert list(matrix.PUBLISHED) == sorted(matrix.PUBLISHED, key=parse_release)
    # Where upstream's connector file changed (read from the wheels).
    variants = {"0.11.0", "0.11.1", "0.12.0", "0.14.0", "0.16.0", "0.21.0", "0.23.0"}
    variants |= {"0.24.0", "0.26.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.33.0"}
    variants |= {"0.34.0"}
    assert variants <= set(matrix.TESTED)


def test_unparseable_versions_have_no_policy():
    assert parse_release("main") is None and policy_for("main") is None
    assert policy_for("0.23.0+cpu").decision == "applied"


def test_the_upstream_files_are_the_ones_the_gating_and_tests_use():
    from tests import helpers

    assert Path(matrix.CONNECTOR_FILE) == helpers.CONNECTOR_PATH
    assert matrix.UPSTREAM_TEST_FILE == helpers.UPSTREAM_TEST_PATH
