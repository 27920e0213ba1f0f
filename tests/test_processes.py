"""The patch in fresh interpreters and spawned children, on the installed vLLM."""

from __future__ import annotations

from textwrap import dedent

import pytest

from tests.conftest import (
    applied_reason,
    patches_by_release,
    run_fresh,
    status_command,
)

# Prints the state of the real methods as the last line of the child's stdout.
REPORT = """
import json, sys, wrapt
import vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector as m
def wrappers(owner, name):
    return len(list(wrapt.wrapper_chain(getattr(m, owner).__dict__[name]))) - 1
status = None
if "vllm_kvfill_patch" in sys.modules:
    s = sys.modules["vllm_kvfill_patch"].status()
    status = {"decision": s.decision.value, "reason": s.reason,
              "version": s.vllm_version}
print(json.dumps({
    "fill_blocks_wrappers": wrappers("DecodeBenchConnectorWorker", "_fill_blocks"),
    "register_wrappers": wrappers("DecodeBenchConnector", "register_kv_caches"),
    "status": status,
}))
"""

CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"

IMPORT_ORDERS = {
    "overlay-before-vllm": "import vllm_kvfill_patch\nimport vllm\nimport " + CONNECTOR,
    "after-import-vllm": "import vllm\nimport vllm_kvfill_patch\nimport " + CONNECTOR,
    "after-the-connector": f"import {CONNECTOR}\nimport vllm_kvfill_patch",
    "apply-twice": (
        f"import {CONNECTOR}\nimport vllm_kvfill_patch as p\np.apply()\np.apply()"
    ),
    "revert-then-apply": (
        f"import {CONNECTOR}\nimport vllm_kvfill_patch as p\np.revert()\np.apply()"
    ),
}


@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_import_order_matrix(order, vllm_version):
    report = run_fresh(IMPORT_ORDERS[order] + REPORT)
    assert report["fill_blocks_wrappers"] == 1
    assert report["register_wrappers"] == 1
    assert report["status"] == {
        "decision": "applied",
        "reason": applied_reason(vllm_version),
        "version": vllm_version,
    }
    # One decision line per process; revert and re-apply each log their change.
    expected_lines = 2 if order == "revert-then-apply" else 1
    assert report["stdout"].count("vllm-kvfill-patch applied") == expected_lines


def test_importing_the_package_imports_neither_vllm_nor_torch():
    code = """
    import json, sys
    import vllm_kvfill_patch
    status = vllm_kvfill_patch.status()
    loaded = sorted(m for m in ("vllm", "torch") if m in sys.modules)
    print(json.dumps({"loaded": loaded, "decision": status.decision.value}))
    """
    report = run_fresh(dedent(code))
    assert report["loaded"] == [] and report["decision"] == "pending"


def test_revert_leaves_upstream_methods_in_a_fresh_interpreter():
    report = run_fresh(
        f"import {CONNECTOR}\nimport vllm_kvfill_patch as p\np.revert()" + REPORT
    )
    assert report["fill_blocks_wrappers"] == 0 and report["register_wrappers"] == 0
    assert report["status"]["decision"] == "inert"


SPAWNED_CHILD = """
import json, multiprocessing as mp, sys

def child(queue):
    import vllm.plugins
    before = "vllm_kvfill_patch" in sys.modules
    vllm.plugins.load_general_plugins()
    import wrapt
    from {connector} import DecodeBenchConnectorWorker as W
    chain = list(wrapt.wrapper_chain(W.__dict__["_fill_blocks"]))
    status = sys.modules["vllm_kvfill_patch"].status()
    queue.put({{"imported_before_plugins": before, "wrappers": len(chain) - 1,
                "decision": status.decision.value}})

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=child, args=(queue,))
    process.start()
    result = queue.get(timeout=240)
    process.join(60)
    result["exitcode"] = process.exitcode
    result["parent_imported"] = "vllm_kvfill_patch" in sys.modules
    print(json.dumps(result))
"""


def test_spawned_child_is_patched_through_the_entry_point(tmp_path):
    script = tmp_path / "spawn_parent.py"
    script.write_text(SPAWNED_CHILD.format(connector=CONNECTOR))
    report = run_fresh(
        f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    assert report == {
        **report,
        "imported_before_plugins": False,
        "parent_imported": False,
        "wrappers": 1,
        "decision": "applied",
        "exitcode": 0,
    }


KILL_SWITCH_CASES = {
    "set-before-start": ("", {"KVFILL_PATCH_DISABLE": "1"}),
    "set-after-import": ("os.environ['KVFILL_PATCH_DISABLE'] = 'yes'", {}),
}


@pytest.mark.parametrize("case", KILL_SWITCH_CASES)
def test_kill_switch_leaves_vllm_untouched(case):
    set_switch, env = KILL_SWITCH_CASES[case]
    code = f"""
    import os, vllm_kvfill_patch, vllm.plugins
    {set_switch}
    vllm.plugins.load_general_plugins()
    import {CONNECTOR}
    """
    report = run_fresh(dedent(code) + REPORT, env=env)
    assert report["fill_blocks_wrappers"] == 0 and report["register_wrappers"] == 0
    assert report["status"]["decision"] == "disabled"
    assert "KVFILL_PATCH_DISABLE" in report["status"]["reason"]
    assert "vllm-kvfill-patch disabled" in report["stdout"]


UNKNOWN_TARGETS = {
    # name: (replacement _fill_blocks source, expected words of the reason)
    "changed-signature": (
        "def _fill_blocks(self, group_idx, block_ids):\n    pass",
        "found _fill_blocks('self', 'group_idx', 'block_ids')",
    ),
    "writes-nothing": (
        "def _fill_blocks(self, group_idx, block_ids, num_tokens):\n    pass",
        "it wrote nothing",
    ),
    "raises-otherwise": (
        "def _fill_blocks(self, group_idx, block_ids, num_tokens):\n"
        "    raise KeyError('layout')",
        "it raised KeyError",
    ),
}


@pytest.mark.parametrize("target", UNKNOWN_TARGETS)
def test_unknown_target_is_refused_logged_and_vllm_still_imports(target):
    # A post-import hook registered first runs first: it plays a vLLM whose
    # _fill_blocks is not one this package knows, before the patch's hook.
    source, reason = UNKNOWN_TARGETS[target]
    code = f"""
    import wrapt
    def change_target(module):
        namespace = {{}}
        exec({source!r}, namespace)
        module.DecodeBenchConnectorWorker._fill_blocks = namespace["_fill_blocks"]
    wrapt.register_post_import_hook(change_target, "{CONNECTOR}")
    import vllm_kvfill_patch
    import {CONNECTOR}
    """
    report = run_fresh(dedent(code) + REPORT)
    assert report["fill_blocks_wrappers"] == 0 and report["register_wrappers"] == 0
    assert report["status"]["decision"] == "refused"
    assert reason in report["status"]["reason"]
    assert "vllm-kvfill-patch refused" in report["stdout"]


def test_a_failing_hook_is_contained_and_the_import_succeeds():
    code = f"""
    import vllm_kvfill_patch, vllm_kvfill_patch.gating as gating
    def broken(*args):
        raise RuntimeError("boom")
    vllm_kvfill_patch.judge = broken
    import {CONNECTOR}
    import {CONNECTOR} as again
    """
    report = run_fresh(dedent(code) + REPORT)
    assert report["fill_blocks_wrappers"] == 0
    assert report["status"]["decision"] == "refused"
    assert "RuntimeError: boom" in report["status"]["reason"]


def test_status_command_prints_the_decision(vllm_version):
    out = status_command()
    assert f"vLLM version: {vllm_version}" in out
    assert "decision:     applied" in out
    patch = patches_by_release().get(vllm_version)
    if patch:
        assert f"patch file:   {patch} (for this release)" in out
    else:
        assert "patch files:  " in out and "patches/" in out
