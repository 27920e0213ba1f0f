"""patches/: each file applies to its release's real connector file and
behaves exactly like the overlay (the same behaviour tests, run on it).

Run in the sessions of releases that have a patch file (see noxfile.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_fresh
from vllm_kvfill_patch.gating import CONNECTOR_MODULE

ROOT = Path(__file__).resolve().parent.parent
CONNECTOR_PATH = Path(*CONNECTOR_MODULE.split(".")).with_suffix(".py")
PATCH_NAME = re.compile(r"^\d{4}-.*-v(\d+\.\d+\.\d+)\.patch$")


def patches_by_release() -> dict[str, Path]:
    return {
        PATCH_NAME.match(p.name).group(1): p
        for p in sorted((ROOT / "patches").glob("*.patch"))
        if PATCH_NAME.match(p.name)
    }


@pytest.fixture(scope="module")
def patch_file(vllm_version) -> Path:
    patch = patches_by_release().get(vllm_version)
    assert patch, f"no patch in patches/ targets vLLM {vllm_version}"
    return patch


@pytest.fixture(scope="module")
def release_tree(tmp_path_factory, vllm_version) -> Path:
    """A temporary tree holding the installed release's real connector file."""
    import vllm

    installed = Path(vllm.__file__).parent.parent / CONNECTOR_PATH
    tree = tmp_path_factory.mktemp(f"vllm-{vllm_version}")
    (tree / CONNECTOR_PATH).parent.mkdir(parents=True)
    shutil.copy(installed, tree / CONNECTOR_PATH)
    return tree


def git_apply(tree: Path, patch: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "apply", *options, str(patch)], cwd=tree, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def patched_connector(tmp_path_factory, release_tree, patch_file) -> Path:
    tree = tmp_path_factory.mktemp("patched")
    shutil.copytree(release_tree, tree, dirs_exist_ok=True)
    result = git_apply(tree, patch_file)
    assert result.returncode == 0, result.stderr
    return tree / CONNECTOR_PATH


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


def behaviour_test_ids(env: dict | None = None) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "behaviour"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
    )
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_patched_file_passes_the_same_behaviour_tests(patched_connector):
    import os

    expected = behaviour_test_ids()
    assert len(expected) >= 10
    env = {**os.environ, "KVFILL_CONNECTOR_FILE": str(patched_connector)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "behaviour",
            "-p",
            "no:cacheprovider",
        ],
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
