"""Fixtures on real vLLM. A missing vLLM fails every test, naming the fix."""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import zygote
from tests.children import load_connector_file
from tests.helpers import (
    BUILD_COMMAND,
    CONNECTOR_PATH,
    ROOT,
    git_apply,
    patches_by_release,
)
from tests.tiny_model import write_tiny_model

# Neither vLLM, wrapt nor this package is imported before pytest_configure
# has forked the zygote (tests/zygote.py).

PATCHED_CONNECTOR_FILE = os.environ.get("KVFILL_CONNECTOR_FILE")
"""An upstream connector file with a patch from patches/ applied: when set,
it is loaded in place of the installed one and the overlay is switched off."""


def pytest_configure(config: pytest.Config) -> None:
    # Tests run here: not an xdist controller, whose workers have their own
    # zygote each, nor a --collect-only, nor pytest started outside the
    # checkout (the wheel's tests), where every fresh process is a cold one.
    controller = getattr(config.option, "numprocesses", None)
    outside = not Path.cwd().is_relative_to(ROOT)
    if not (controller or config.option.collectonly or outside):
        zygote.start()
    if PATCHED_CONNECTOR_FILE:
        os.environ["KVFILL_PATCH_DISABLE"] = "1"
        load_connector_file(PATCHED_CONNECTOR_FILE)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`commit_index`: each commit of the installed release's patch series."""
    if "commit_index" in metafunc.fixturenames:
        from vllm_kvfill_patch.__main__ import installed_vllm_version

        release = (installed_vllm_version() or "").split("+")[0]
        series = patches_by_release().get(release, [])
        ids = [patch.name[:4] for patch in series]
        metafunc.parametrize("commit_index", range(len(series)), ids=ids)


def pytest_unconfigure(config: pytest.Config) -> None:
    zygote.stop()
    # The interpreter's exit then skips collecting everything torch and vLLM
    # allocated: 2 s a session here.
    gc.freeze()


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


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, vllm_version):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def vllm_config_for(tiny_model):
    """`vllm_config_for(fill_mean=..., fill_std=...)`: real VllmConfigs, cached.

    One is built (vLLM inspects the model in a subprocess: ~10 s here); the
    others are copies of it with their own kv_connector_extra_config, the
    only field the connector reads them from.
    """
    import copy

    from tests.hybrid import make_vllm_config

    base = make_vllm_config(tiny_model)
    cache = {}

    def build(**extra):
        # repr, not the values: True == 1, and NaN is not equal to itself.
        key = repr(sorted(extra.items()))
        if key not in cache:
            config = copy.deepcopy(base)
            config.kv_transfer_config.kv_connector_extra_config = dict(extra)
            cache[key] = config
        return cache[key]

    return build


@pytest.fixture(scope="module")
def patch_series(vllm_version) -> list[Path]:
    series = patches_by_release().get(vllm_version)
    assert series, f"no patch series in patches/ targets vLLM {vllm_version}"
    return series


@pytest.fixture(scope="module")
def release_tree(tmp_path_factory, vllm_version) -> Path:
    """A temporary tree holding the installed release's real connector file."""
    import vllm

    installed = Path(vllm.__file__).parent.parent / CONNECTOR_PATH
    tree = tmp_path_factory.mktemp(f"vllm-{vllm_version}")
    (tree / CONNECTOR_PATH).parent.mkdir(parents=True)
    shutil.copy(installed, tree / CONNECTOR_PATH)
    return tree


@pytest.fixture(scope="module")
def patched_connector(tmp_path_factory, release_tree, patch_series) -> Path:
    """The release's connector file with its whole patch series applied."""
    tree = tmp_path_factory.mktemp("patched")
    shutil.copytree(release_tree, tree, dirs_exist_ok=True)
    for patch in patch_series:
        result = git_apply(tree, patch)
        assert result.returncode == 0, f"{patch.name}: {result.stderr}"
    return tree / CONNECTOR_PATH


@pytest.fixture
def implementation(vllm_version):
    """For the modules whose ``behaviour`` tests also run against patches/:
    the overlay, applied (and left applied), or the patched upstream file."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import decode_bench_connector

    import vllm_kvfill_patch
    from vllm_kvfill_patch import Decision

    if PATCHED_CONNECTOR_FILE:
        assert decode_bench_connector.__file__ == PATCHED_CONNECTOR_FILE
        assert vllm_kvfill_patch.status().decision is Decision.DISABLED
        yield "patch file"
        return
    assert vllm_kvfill_patch.apply().decision is Decision.APPLIED
    yield "overlay"
    vllm_kvfill_patch.apply()


UPSTREAM_TREE = os.environ.get("KVFILL_UPSTREAM_TREE")
"""vLLM's source tree of the installed release, as the noxfile's upstream
session prepares it: a git tree whose commit tagged ``v<release>`` holds the
files the patch series changes."""


@pytest.fixture(scope="session")
def upstream_tree(vllm_version) -> Path:
    if not UPSTREAM_TREE:
        pytest.fail(
            "these tests need vLLM's source tree (KVFILL_UPSTREAM_TREE); build it "
            f"with: python3 -m nox -s 'upstream({vllm_version.split('+')[0]})'",
            pytrace=False,
        )
    return Path(UPSTREAM_TREE)


@pytest.fixture(scope="session")
def series_commits(upstream_tree, vllm_version) -> list[str]:
    """The release's patch series applied in order with ``git am
    --keep-non-patch`` on its tag: the commits, oldest first."""
    release = vllm_version.split("+")[0]
    series = patches_by_release()[release]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=kvfill", "-c", "user.email=kvfill@localhost",
             *args],
            cwd=upstream_tree, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip

    subprocess.run(["git", "am", "--abort"], cwd=upstream_tree, capture_output=True)
    git("checkout", "-q", "-f", "--detach", f"v{release}")
    git("am", "--keep-non-patch", *map(str, series))
    return git("rev-list", "--reverse", f"v{release}..HEAD").split()


@pytest.fixture
def vllm_log():
    """What vLLM's loggers (the patch's among them; they do not propagate) say."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vllm").addHandler(handler)
    yield records
    logging.getLogger("vllm").removeHandler(handler)
