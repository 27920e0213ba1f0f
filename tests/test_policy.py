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
from vllm_kvfill_patch.releases import (
    PATCH_SERIES,
    SUPPORT_POLICY,
    parse_release,
    policy_for,
    series_range_for,
)

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
    assert set(run) == set(defined) - NOT_TESTS - set(noxfile.OUTSIDE_CI)


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


README = ROOT / "README.md"
SERIES_LINE = re.compile(r"^- `v(\d+\.\d+\.\d+)/`, for (?:forks of )?(.+?)[:,]", re.M)
NO_SERIES_LINE = re.compile(r"^- none for (.+?):", re.M)


def upstreaming_ranges(readme: str) -> tuple[dict[str, str], list[str]]:
    """The README's Upstreaming section: each series' range, and the ranges
    it says no series applies to."""
    section = readme.split("## Upstreaming", 1)[1].split("\n## ", 1)[0]
    gaps = [
        name for m in NO_SERIES_LINE.finditer(section) for name in m[1].split(" and ")
    ]
    return dict(SERIES_LINE.findall(section)), gaps


def test_the_readme_gives_the_ranges_of_the_series_table():
    series, gaps = upstreaming_ranges(README.read_text())
    assert series == {r.series: r.name for r in PATCH_SERIES if r.series}
    assert gaps == [r.name for r in PATCH_SERIES if r.series is None]
    # A range the README names otherwise is found.
    moved = README.read_text().replace(
        "forks of 0.31 – 0.33.x", "forks of 0.31 – 0.32.x"
    )
    assert upstreaming_ranges(moved)[0]["0.33.0"] == "0.31 – 0.32.x"


def test_the_series_table_covers_its_releases_once_each_with_a_series_of_patches():
    for before, after in zip(PATCH_SERIES, PATCH_SERIES[1:], strict=False):
        assert before.end == after.first
    on_disk = matrix.patches_by_release(ROOT / "patches")
    named = [r.series for r in PATCH_SERIES if r.series]
    assert sorted(named, key=parse_release) == sorted(on_disk, key=parse_release)
    for release in on_disk:  # each series is for its own release
        assert series_range_for(release).series == release
    for gap in (r for r in PATCH_SERIES if r.series is None):
        taken = re.match(r"patches/v(\S+)/ comes closest: ", gap.instead)
        assert taken and taken[1] in on_disk, gap.instead


def run_status_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_kvfill_patch", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_the_status_command_names_itself_as_it_is_run():
    done = run_status_command("--help")
    assert done.returncode == 0
    assert done.stdout.startswith("usage: python -m vllm_kvfill_patch [-h] [--patch]")


def test_patch_says_which_series_to_take_where_none_applies():
    from vllm_kvfill_patch.__main__ import mailbox, no_series

    assert mailbox("0.27.0") is None
    assert no_series("0.27.0").startswith(
        "No patch series applies to vLLM 0.27.0: patches/v0.23.0/ comes closest: "
    )
    assert (
        no_series("0.10.2")
        == "vLLM 0.10.2 has no DecodeBenchConnector: nothing to patch."
    )
    # No vLLM in this environment: said on stderr, exit 1, nothing for git am.
    done = run_status_command("--patch")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == "No vLLM is installed here: no patch series to print.\n"
