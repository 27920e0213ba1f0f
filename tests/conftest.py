"""Fixtures on real vLLM. A missing vLLM fails every test, naming the fix."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_kvfill_patch.gating import CONNECTOR_MODULE, parse_release

ROOT = Path(__file__).resolve().parent.parent
CONNECTOR_PATH = Path(*CONNECTOR_MODULE.split(".")).with_suffix(".py")
PATCH_NAME = re.compile(r"^\d{4}-.*-v(\d+\.\d+\.\d+)\.patch$")
BUILD_COMMAND = "python3 -m nox  (see README.md, 'Running the tests')"

PATCHED_CONNECTOR_FILE = os.environ.get("KVFILL_CONNECTOR_FILE")
"""An upstream connector file with a patch from patches/ applied: when set,
it is loaded in place of the installed one and the overlay is switched off."""


def load_connector_file(path: str):
    """Load `path` as vLLM's connector module, in place of the installed one.

    vLLM's connector package imports the original while it loads, so it is
    loaded first and the module is then swapped in sys.modules and on the
    package, where both ``import`` forms and vLLM's factory look it up.
    """
    parent_name, _, child = CONNECTOR_MODULE.rpartition(".")
    parent = importlib.import_module(parent_name)
    spec = importlib.util.spec_from_file_location(CONNECTOR_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[CONNECTOR_MODULE] = module
    setattr(parent, child, module)
    return module


if PATCHED_CONNECTOR_FILE:
    os.environ["KVFILL_PATCH_DISABLE"] = "1"
    load_connector_file(PATCHED_CONNECTOR_FILE)


@pytest.fixture(scope="session")
def vllm_version() -> str:
    """The installed real vLLM's version; no vLLM fails, naming the fix."""
    try:
        import vllm
    except Exception as exc:  # noqa: BLE001 - any failure means no usable vLLM
        pytest.fail(
            f"these tests need a real vLLM ({exc!r}); build the environment "
            f"with: {BUILD_COMMAND}",
            pytrace=False,
        )
    return vllm.__version__


def applied_reason(vllm_version: str) -> str:
    """Why the patch applies to this release, as upstream's code behaves there."""
    if parse_release(vllm_version) < (0, 24, 0):
        return "_fill_blocks crashes on list/tuple (Mamba) caches"
    return "_fill_blocks fills list/tuple state tensors whole"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, vllm_version):
    from vllm_kvfill_patch.demo import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def vllm_config_for(tiny_model):
    """`vllm_config_for(fill_mean=..., fill_std=...)`: real VllmConfigs, cached."""
    from tests.hybrid import make_vllm_config

    cache = {}

    def build(**extra):
        key = tuple(sorted(extra.items()))
        if key not in cache:
            cache[key] = make_vllm_config(tiny_model, **extra)
        return cache[key]

    return build


def run_fresh(code: str, env: dict | None = None, timeout: float = 300) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object last.

    Returns that object with the child's stderr under "stderr".
    """
    child_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=timeout,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 0 and lines, (
        f"child failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    )
    report = json.loads(lines[-1])
    report["stderr"] = result.stderr
    report["stdout"] = result.stdout
    return report


def status_command() -> str:
    """What `python -m vllm_kvfill_patch` prints, in a fresh interpreter."""
    result = subprocess.run(
        [sys.executable, "-m", "vllm_kvfill_patch"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    return result.stdout


# patches/: the release file, and that file with its patch applied.


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
