"""Releases where the patch must stay out: upstream's methods stay its own."""

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
    if report["connector"]:
        assert report["_fill_blocks"] == 0 and report["register_kv_caches"] == 0
        assert status["reason"] == (
            "upstream's worker builds its own per-group layer map from the "
            "KV-cache config"
        )
    else:
        assert status["reason"] == "no DecodeBenchConnector in this vLLM (or no vLLM)"


def test_import_after_the_connector_is_inert_too(vllm_version):
    connector_exists = run_fresh(children.run_steps, [])["connector"] or (
        policy_for(vllm_version).why != "no DecodeBenchConnector in this release"
    )
    steps = ["import connector"] if connector_exists else []
    report = run_fresh(children.run_steps, [*steps, "import package", "apply"])
    # Without the connector the hook never fires: the decision stays pending
    # until the plugin (or the status command) looks for the module.
    expected = "inert" if connector_exists else "pending"
    assert report["status"]["decision"] == expected


def test_status_command_prints_inert(vllm_version):
    out = status_command()
    assert f"vLLM version: {vllm_version}" in out
    assert "decision:     inert" in out
