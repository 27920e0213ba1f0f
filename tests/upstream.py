"""vLLM's own gates, as its source distribution defines them: the Python hooks
of its pre-commit config, at the versions it pins, and its own tests.

pre-commit itself would fetch each hook's repository; here each hook runs from
the same tool release, installed from the package index (the noxfile builds
that environment from `hook_requirements`), in check mode.

`python -m tests.upstream requirements TREE` prints the hook tools to install.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

import yaml

PYTHON_HOOKS = (
    "ruff-check",
    "ruff-format",
    "typos",
    "mypy",
    "check-spdx-header",
    "check-root-lazy-imports",
    "check-forbidden-imports",
    "check-torch-cuda-call",
    "check-boolean-context-manager",
    "check-trust-remote-code",
    "check-test-tethering",
)
"""The hooks of vLLM's pre-commit config that look at Python files."""

REMOTE_HOOK_COMMANDS = {
    "ruff-check": ["ruff", "check", "--force-exclude", "--output-format", "github"],
    "ruff-format": ["ruff", "format", "--force-exclude", "--check"],
    "typos": ["typos", "--force-exclude"],
}
"""What the hook repositories' own hook definitions run, without fixing."""

REMOTE_HOOK_PACKAGES = {"ruff-pre-commit": "ruff", "typos": "typos"}
"""Hook repository -> the package index distribution of the same release."""


@dataclass(frozen=True)
class Hook:
    id: str
    command: list[str]
    files: str | None = None

    def applies_to(self, path: str) -> bool:
        return path.endswith(".py") and (
            self.files is None or re.search(self.files, path) is not None
        )


def _config(tree: Path) -> list[dict]:
    return yaml.safe_load((tree / ".pre-commit-config.yaml").read_text())["repos"]


FROZEN_REV = re.compile(
    r"^\s*rev:\s*([0-9a-f]{40})\s*#\s*frozen:\s*(\S+)", re.MULTILINE
)
"""A rev that ``pre-commit autoupdate --freeze`` wrote (vLLM 0.34+): the
commit, and the tag it was, in a comment YAML drops."""


def hook_requirements(tree: Path) -> list[str]:
    """The tools of PYTHON_HOOKS, pinned as the tree's pre-commit config pins
    them (a remote hook's rev is its tool's release, or the commit of it)."""
    text = (tree / ".pre-commit-config.yaml").read_text()
    tags = dict(FROZEN_REV.findall(text))
    requirements = []
    for repo in _config(tree):
        name = repo["repo"].rstrip("/").rpartition("/")[2]
        ids = {hook["id"] for hook in repo["hooks"]} & set(PYTHON_HOOKS)
        if name in REMOTE_HOOK_PACKAGES and ids:
            version = tags.get(repo["rev"], repo["rev"]).removeprefix("v")
            requirements.append(f"{REMOTE_HOOK_PACKAGES[name]}=={version}")
        for hook in repo["hooks"]:
            if hook["id"] in PYTHON_HOOKS:
                requirements += hook.get("additional_dependencies", [])
    return sorted(set(requirements))


def python_hooks(tree: Path) -> list[Hook]:
    """PYTHON_HOOKS as the tree's pre-commit config defines them."""
    hooks = []
    for repo in _config(tree):
        for hook in repo["hooks"]:
            if hook["id"] not in PYTHON_HOOKS:
                continue
            if hook["id"] in REMOTE_HOOK_COMMANDS:
                command = REMOTE_HOOK_COMMANDS[hook["id"]]
            else:
                command = shlex.split(hook["entry"]) + hook.get("args", [])
            hooks.append(Hook(hook["id"], command, hook.get("files")))
    return hooks


def run_hook(hook: Hook, tree: Path, files: list[str], tools: Path, mypy_cache: Path):
    """Run `hook` on those of `files` it applies to, with the tools in `tools`
    (a bin directory, first on PATH; its python runs the local hooks) and
    `mypy_cache` as mypy's cache directory; None where it applies to none of
    them (pre-commit does not run it then)."""
    selected = [path for path in files if hook.applies_to(path)]
    if not selected:
        return None
    env = {
        **os.environ,
        "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
        "MYPY_CACHE_DIR": str(mypy_cache),
    }
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run(
        [*hook.command, *selected],
        cwd=tree, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def mypy_cache_of(tree: Path, position: int) -> Path:
    """mypy's cache for the series' commit at `position` (0 the first), in
    `tree`: one per commit, started from a copy of the commit before's.

    mypy rechecks what changed since its cache was written (content hashes
    decide), so a result never depends on the cache. With one cache for
    every commit, each commit's connector was rechecked against the last
    one's at every run (15 s a commit; 22 s without a cache); with its own,
    an unchanged commit takes 3 s.
    """
    cache = tree / f".mypy_cache-series-{position + 1}"
    before = tree / f".mypy_cache-series-{position}"
    if not cache.exists() and before.is_dir():
        partial = cache.with_name(cache.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(before, partial)
        partial.rename(cache)
    return cache


def run_upstream_tests(tree: Path, test_file: str, *pytest_args: str) -> dict[str, str]:
    """Run upstream's `test_file` in `tree` (whose vLLM sources it imports),
    in a child of the zygote (the third-party imports already done): each
    test's outcome ("passed", "failed", "error", "skipped") by name."""
    from tests import children
    from tests.helpers import run_forked

    report = tree / ".kvfill-junit.xml"
    report.unlink(missing_ok=True)
    arguments = ["-q", f"--junitxml={report}", test_file, *pytest_args]
    exitcode, result, stdout, stderr = run_forked(
        children.pytest_in, (str(tree), arguments), {}, timeout=900
    )
    assert report.exists(), f"upstream's pytest ({exitcode}):\n{stdout}\n{stderr}"
    # The tree's own sources were tested, not the installed wheel.
    assert result["vllm"] == str(tree / "vllm" / "__init__.py"), result
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        outcomes[case.get("name")] = outcome
    return outcomes


def added_test_functions(diff: str) -> list[str]:
    """Test functions a diff adds (`+def test_...`)."""
    return re.findall(r"^\+def (test_\w+)\(", diff, re.MULTILINE)


if __name__ == "__main__":
    command, tree = sys.argv[1:3]
    assert command == "requirements", command
    print("\n".join(hook_requirements(Path(tree))))
