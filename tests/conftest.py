"""Fixtures on real vLLM. A missing vLLM fails every test, naming the fix."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest

from tests import zygote
from tests.children import load_connector_file
from tests.helpers import BUILD_COMMAND, CONNECTOR_PATH, git_apply, patches_by_release

# Neither vLLM, wrapt nor this package is imported before pytest_configure
# has forked the zygote (tests/zygote.py).

PATCHED_CONNECTOR_FILE = os.environ.get("KVFILL_CONNECTOR_FILE")
"""An upstream connector file with a patch from patches/ applied: when set,
it is loaded in place of the installed one and the overlay is switched off."""


def pytest_configure(config: pytest.Config) -> None:
    # Tests run here: not an xdist controller, whose workers have their own
    # zygote each, nor a --collect-only.
    if not (getattr(config.option, "numprocesses", None) or config.option.collectonly):
        zygote.start()
    if PATCHED_CONNECTOR_FILE:
        os.environ["KVFILL_PATCH_DISABLE"] = "1"
        load_connector_file(PATCHED_CONNECTOR_FILE)


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
    from vllm_kvfill_patch.demo import write_tiny_model

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
        key = tuple(sorted(extra.items()))
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
