"""The patch in fresh processes, on the installed vLLM (a spawned child:
tests/test_spawned.py).

Each scenario is a function in tests/children.py, run in a fresh process
(``helpers.run_fresh``: forked from the zygote, which has imported torch and
transformers, never vLLM, wrapt or this package).
"""

from __future__ import annotations

from importlib import metadata

import pytest

from tests import children
from tests.helpers import (
    DECODE_NODE_DEFAULT,
    NOTHING_WRAPPED,
    applied_parts,
    applied_reason,
    decision_lines,
    patches_by_release,
    run_fresh,
    status_command,
    wrappers_for,
)

IMPORT_ORDERS = {
    # vLLM's plugin loader alone, as in a worker nobody imported the package in.
    "entry-point-alone": ["load plugins", "import connector"],
    "overlay-before-vllm": ["import package", "import vllm", "import connector"],
    "after-import-vllm": ["import vllm", "import package", "import connector"],
    "after-the-connector": ["import connector", "import package"],
    "apply-twice": ["import connector", "import package", "apply", "apply"],
    "revert-then-apply": ["import connector", "import package", "revert", "apply"],
}


@pytest.mark.parametrize("order", IMPORT_ORDERS)
def test_import_order_matrix(order, vllm_version):
    # Each order ends as an engine starts: vLLM configures its logging.
    report = run_fresh(children.run_steps, [*IMPORT_ORDERS[order], "configure logging"])
    assert report["wrappers"] == wrappers_for(applied_parts(vllm_version))
    assert report["status"] == {
        "decision": "applied",
        "reason": applied_reason(vllm_version),
        "version": vllm_version,
        "parts": applied_parts(vllm_version),
    }
    # One decision line per process, however late vLLM configures its
    # logging (0.31+: when an engine starts, after the decision here): the
    # line is held until then, and vLLM's function is its own again after.
    # Where logging was configured first, revert and re-apply each log their
    # change; a held line is replaced by the newer decision.
    expected_lines = 1
    if order == "revert-then-apply" and not report["vllm_logging_configured_late"]:
        expected_lines = 2
    assert decision_lines(report, "applied") == expected_lines
    assert report["logging_configuration_wrappers"] == 0


def test_importing_the_package_imports_neither_vllm_nor_torch(tmp_path):
    # A cold interpreter: the zygote has torch loaded.
    report = run_fresh(children.modules_loaded_by_importing_the_package, cwd=tmp_path)
    assert report["loaded"] == ["wrapt"] and report["decision"] == "pending"


def test_revert_leaves_upstream_methods_in_a_fresh_interpreter():
    report = run_fresh(
        children.run_steps, ["import connector", "import package", "revert"]
    )
    assert report["wrappers"] == NOTHING_WRAPPED
    assert report["status"]["decision"] == "reverted"
    assert report["status"]["reason"] == "reverted by revert()"


KILL_SWITCH_CASES = {
    "set-before-start": (["import package"], {"KVFILL_PATCH_DISABLE": "1"}),
    "set-after-import": (["import package", "set kill switch"], {}),
}


def test_by_default_a_preempted_request_is_recomputed_as_on_a_decode_node(
    vllm_version,
):
    report = run_fresh(
        children.semantics_report,
        ["import package", "load plugins", "import connector"],
    )
    assert report["status"]["parts"] == applied_parts(vllm_version)
    assert report["status"]["reason"].endswith(f"; semantics: {DECODE_NODE_DEFAULT}")
    assert (report["refill"], report["zero-token"]) == ("upstream", "not offered")


REFILL_SWITCHES = {
    "1": (True, "a decode node with an offload tier: a preempted request filled "
          "again (KVFILL_PATCH_REFILL=1)"),
    "0": (False, "a decode node's: each request filled once, a preempted request "
          "recomputed (KVFILL_PATCH_REFILL=0)"),
    "maybe": (False, "a decode node's: each request filled once, a preempted "
              "request recomputed (the refill is opt-in: refill_preempted in the "
              "connector's options; KVFILL_PATCH_REFILL='maybe' is neither 1 nor "
              "0, ignored)"),
}  # fmt: skip


@pytest.mark.parametrize("switch", REFILL_SWITCHES)
def test_the_refill_switch_sets_the_semantics_and_says_so(switch, vllm_version):
    refill, semantics = REFILL_SWITCHES[switch]
    report = run_fresh(
        children.semantics_report,
        ["import package", "load plugins", "import connector"],
        env={"KVFILL_PATCH_REFILL": switch},
    )
    parts = applied_parts(vllm_version, refill=refill)
    assert report["wrappers"] == wrappers_for(parts)
    assert report["status"]["parts"] == parts
    assert report["status"]["reason"] == applied_reason(vllm_version, semantics)
    assert report["refill"] == ("refill" if refill else "upstream")
    # The refill reloads what a preempted request held, generated tokens too.
    assert report["zero-token"] == ("offered" if refill else "not offered")


@pytest.mark.parametrize("case", KILL_SWITCH_CASES)
def test_kill_switch_leaves_vllm_untouched(case):
    steps, env = KILL_SWITCH_CASES[case]
    report = run_fresh(
        children.run_steps,
        [*steps, "load plugins", "import connector", "configure logging"],
        env=env,
    )
    assert report["wrappers"] == NOTHING_WRAPPED
    assert report["status"]["decision"] == "disabled"
    assert report["status"]["reason"] == "KVFILL_PATCH_DISABLE is set"
    assert decision_lines(report, "disabled") == 1


UNKNOWN_TARGET_REASONS = {
    "changed-signature": (
        "expected _fill_blocks('self', 'group_idx', 'block_ids', 'num_tokens'), "
        "found _fill_blocks('self', 'group_idx', 'block_ids')"
    ),
    "writes-nothing": (
        "expected _fill_blocks to crash on, or fill, a list state cache; "
        "it wrote nothing"
    ),
    "raises-otherwise": (
        "expected the fill probes to run on the connector's own methods; "
        "they raised KeyError: 'layout'"
    ),
}


@pytest.mark.parametrize("target", UNKNOWN_TARGET_REASONS)
def test_unknown_target_is_refused_logged_and_vllm_still_imports(target):
    report = run_fresh(children.unknown_target_report, target)
    assert report["wrappers"] == NOTHING_WRAPPED
    assert report["status"]["decision"] == "refused"
    assert report["status"]["reason"] == UNKNOWN_TARGET_REASONS[target]
    assert decision_lines(report, "refused") == 1


def test_a_failing_hook_is_contained_and_the_import_succeeds():
    report = run_fresh(children.failing_hook_report)
    assert report["wrappers"] == NOTHING_WRAPPED
    assert report["status"]["decision"] == "refused"
    assert report["status"]["reason"] == "installing failed: RuntimeError: boom"


def upstream_behaviour(vllm_version: str) -> str:
    crashes = "crashes" in applied_reason(vllm_version)
    return "upstream crash" if crashes else "upstream whole"


FILL_ONCE_METHOD = "DecodeBenchConnectorScheduler.update_state_after_alloc"
REFILL_METHOD = "DecodeBenchConnectorScheduler.get_num_new_matched_tokens"
FOREIGN_TARGETS = {
    # A plain closure over the scheduler side's method: revert() cannot take
    # ours out from under it, and takes the fill out; apply() must put it back.
    "plain monkeypatch": FILL_ONCE_METHOD,
    "wrapt wrapper": "DecodeBenchConnector.start_load_kv",
}


@pytest.mark.parametrize("foreign", list(FOREIGN_TARGETS))
def test_revert_and_apply_hold_under_another_patch(foreign, vllm_version):
    report = run_fresh(
        children.foreign_patch_report,
        foreign,
        ["revert", "apply", "set kill switch", "apply", "revert"],
        FOREIGN_TARGETS[foreign],
    )
    assert report["raised"] is None
    steps = {entry["step"] + str(i): entry for i, entry in enumerate(report["after"])}
    upstream = upstream_behaviour(vllm_version)
    assert steps["revert0"]["decision"] == "reverted"
    assert (steps["revert0"]["behaviour"], steps["revert0"]["zero-token"]) == (
        upstream,
        "offered",
    )
    assert steps["apply1"]["decision"] == "applied"
    assert steps["apply1"]["reason"] == applied_reason(vllm_version)
    assert (steps["apply1"]["behaviour"], steps["apply1"]["zero-token"]) == (
        "patched",
        "not offered",
    )
    assert steps["apply3"]["decision"] == "disabled"
    assert (steps["apply3"]["behaviour"], steps["apply3"]["zero-token"]) == (
        upstream,
        "offered",
    )
    if foreign == "plain monkeypatch":
        # Ours cannot be spliced out from under a plain closure: it stays,
        # passing calls through, and the status says so.
        stuck = (
            "; another library's plain wrapper sits above ours on "
            f"{FILL_ONCE_METHOD}: ours stays in place and passes every call through"
        )
        assert steps["revert0"]["reason"] == "reverted by revert()" + stuck
        assert steps["apply3"]["reason"] == "KVFILL_PATCH_DISABLE is set" + stuck
    else:
        assert steps["revert0"]["reason"] == "reverted by revert()"


def test_a_wrapper_of_ours_lost_under_a_closure_stays_off(vllm_version):
    """A closure without ``__wrapped__`` over our refill wrapper (switched on)
    hides it and its signature: revert() loses track of ours, apply()
    refuses, and ours under the closure must not come back on."""
    report = run_fresh(
        children.foreign_patch_report,
        "closure without __wrapped__",
        ["revert", "apply"],
        REFILL_METHOD,
        env={"KVFILL_PATCH_REFILL": "1"},
    )
    assert report["raised"] is None
    reverted, applied = report["after"]
    upstream = upstream_behaviour(vllm_version)
    assert (reverted["behaviour"], reverted["refill"]) == (upstream, "upstream")
    assert applied["decision"] == "refused"
    assert (applied["behaviour"], applied["refill"]) == (upstream, "upstream")


def test_a_method_replaced_outright_is_judged_afresh_by_apply(vllm_version):
    report = run_fresh(
        children.foreign_patch_report, "replaced outright", ["revert", "apply"]
    )
    assert report["raised"] is None
    reverted, applied = report["after"]
    assert reverted["decision"] == "reverted"
    assert reverted["behaviour"] == upstream_behaviour(vllm_version)
    # Upstream's own function is in place again: the patch goes back on.
    assert applied["decision"] == "applied" and applied["behaviour"] == "patched"


def test_status_command_prints_the_decision(vllm_version):
    out = status_command()
    ours = metadata.version("vllm-kvfill-patch")
    assert f"hot-fix:      vllm-kvfill-patch {ours}\n" in out
    assert f"vLLM version: {vllm_version}" in out
    assert "decision:     applied" in out
    from vllm_kvfill_patch.releases import series_range_for

    # The series the release's range takes (releases.PATCH_SERIES), if any.
    found = series_range_for(vllm_version)
    series = patches_by_release().get(found.series) if found and found.series else []
    if series:
        names = ", ".join(p.name for p in series)
        assert f"patches:      {len(series)} for this release, in order: {names}" in out
    else:
        assert "patches:      none for this release (--patch says which" in out
