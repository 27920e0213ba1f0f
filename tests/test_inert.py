"""Releases without the connector (< 0.11.1): the patch stays out."""

from __future__ import annotations

from tests import children
from tests.helpers import run_fresh, status_command
from vllm_kvfill_patch.releases import policy_for


def test_release_is_inert_by_policy(vllm_version):
    assert policy_for(vllm_version).decision == "inert"


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
