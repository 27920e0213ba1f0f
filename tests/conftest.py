"""Fixtures on real vLLM. A missing vLLM fails every test, naming the fix."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from vllm_kvfill_patch.gating import CONNECTOR_MODULE

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


def _real_vllm_version() -> str:
    try:
        import vllm
        from vllm.distributed.kv_transfer.kv_connector.v1 import (  # noqa: F401
            decode_bench_connector,
        )
    except Exception as exc:  # noqa: BLE001 - any failure means no usable vLLM
        pytest.fail(
            f"these tests need a real vLLM with DecodeBenchConnector ({exc!r}); "
            f"build the environment with: {BUILD_COMMAND}",
            pytrace=False,
        )
    return vllm.__version__


@pytest.fixture(scope="session")
def vllm_version() -> str:
    return _real_vllm_version()


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
