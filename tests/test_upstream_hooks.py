"""vLLM's pre-commit Python hooks on the files each commit of the newest
patch series changes, at the versions the release's config pins
(tests/upstream.py; the noxfile builds the tools' environment).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.upstream import PYTHON_HOOKS, mypy_cache_of, python_hooks, run_hook


@pytest.fixture(scope="session")
def hook_tools(vllm_version) -> Path:
    tools = os.environ.get("KVFILL_HOOK_TOOLS")
    if not tools:
        pytest.fail(
            "these tests need vLLM's pre-commit tools (KVFILL_HOOK_TOOLS); build "
            f"them with: python3 -m nox -s 'upstream({vllm_version.split('+')[0]})'",
            pytrace=False,
        )
    return Path(tools)


def test_the_config_defines_every_python_hook(upstream_tree):
    assert sorted(hook.id for hook in python_hooks(upstream_tree)) == sorted(
        PYTHON_HOOKS
    )


def test_vllms_python_hooks_pass_on_the_files_each_commit_changes(
    upstream_tree, series_commits, commit_index, hook_tools
):
    commit = series_commits[commit_index]
    subprocess.run(
        ["git", "checkout", "-q", "-f", "--detach", commit],
        cwd=upstream_tree,
        check=True,
    )
    changed = subprocess.run(
        ["git", "diff", "--name-only", f"{commit}~1", commit],
        cwd=upstream_tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert changed
    mypy_cache = mypy_cache_of(upstream_tree, commit_index)
    failed = {}
    for hook in python_hooks(upstream_tree):
        result = run_hook(hook, upstream_tree, changed, hook_tools, mypy_cache)
        if result is not None and result.returncode != 0:
            failed[hook.id] = (result.stdout + result.stderr)[-3000:]
    assert not failed, failed
