"""Releases where the patch must stay out: upstream's methods stay its own."""

from __future__ import annotations

from textwrap import dedent

from tests.conftest import run_fresh, status_command
from vllm_kvfill_patch.gating import CONNECTOR_MODULE, policy_for

PLUGINS_THEN_REPORT = f"""
import importlib.util, json, sys, wrapt
import vllm_kvfill_patch, vllm.plugins
vllm.plugins.load_general_plugins()
report = {{"connector": importlib.util.find_spec("{CONNECTOR_MODULE}") is not None}}
if report["connector"]:
    import {CONNECTOR_MODULE} as m
    for owner, name in [("DecodeBenchConnectorWorker", "_fill_blocks"),
                        ("DecodeBenchConnector", "register_kv_caches")]:
        attribute = getattr(m, owner).__dict__[name]
        report[name] = len(list(wrapt.wrapper_chain(attribute))) - 1
status = vllm_kvfill_patch.status()
report.update(decision=status.decision.value, reason=status.reason,
              version=status.vllm_version)
print(json.dumps(report))
"""


def test_release_is_inert_by_policy(vllm_version):
    assert policy_for(vllm_version).decision.value == "inert"


def test_plugin_leaves_upstream_methods_untouched(vllm_version):
    report = run_fresh(PLUGINS_THEN_REPORT)
    assert report["decision"] == "inert"
    assert report["version"] == vllm_version
    assert report.get("_fill_blocks", 0) == 0
    assert report.get("register_kv_caches", 0) == 0
    if report["connector"]:
        assert "per-group" in report["reason"]
    else:
        assert "no DecodeBenchConnector" in report["reason"]


def test_import_after_the_connector_is_inert_too(vllm_version):
    code = dedent(
        f"""
        import importlib.util, json
        exists = importlib.util.find_spec("{CONNECTOR_MODULE}") is not None
        if exists:
            import {CONNECTOR_MODULE}
        import vllm_kvfill_patch
        decision = vllm_kvfill_patch.apply().decision.value
        print(json.dumps({{"decision": decision, "connector": exists}}))
        """
    )
    report = run_fresh(code)
    # Without the connector the hook never fires: the decision stays pending
    # until the plugin (or the status command) looks for the module.
    assert report["decision"] == ("inert" if report["connector"] else "pending")


def test_status_command_prints_inert(vllm_version):
    out = status_command()
    assert f"vLLM version: {vllm_version}" in out
    assert "decision:     inert" in out
