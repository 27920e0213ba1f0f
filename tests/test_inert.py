"""Releases without the connector (< 0.11.1): the patch stays out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests import children
from tests.helpers import BUILD_COMMAND, CONNECTOR_PATH, run_fresh, status_command


def test_the_installed_vllm_has_no_connector():
    # What makes a release inert, read from its wheel: the policy that chose
    # this suite for it could be wrong.
    vllm = importlib.util.find_spec("vllm")  # found, not imported
    assert vllm is not None and vllm.origin is not None, BUILD_COMMAND
    assert not (Path(vllm.origin).parent.parent / CONNECTOR_PATH).exists()


def test_plugin_leaves_upstream_methods_untouched(vllm_version):
    report = run_fresh(children.run_steps, ["import package", "load plugins"])
    status = report["status"]
    assert status["decision"] == "inert" and status["version"] == vllm_version
    assert not report["connector"]
    assert status["reason"] == "no DecodeBenchConnector in this vLLM (or no vLLM)"


def test_apply_without_the_connector_stays_pending():
    report = run_fresh(children.run_steps, ["import package", "apply"])
    # Without the connector the hook never fires: the decision stays pending
    # until the plugin (or the status command) looks for the module.
    assert report["status"]["decision"] == "pending"


def test_status_command_prints_inert(vllm_version):
    out = status_command()
    assert f"vLLM version: {vllm_version}" in out
    assert "decision:     inert" in out
