"""A child started with `spawn`, as vLLM's CLI starts its processes: a cold
interpreter that inherits nothing, patched by the entry point alone.

Nothing in it depends on the release beyond what the import-order matrix's
"entry-point-alone" order checks in a forked child on every release, and a
cold interpreter costs ~9 s here: the noxfile runs it on the oldest and the
newest applied release (engine workers, `vllm serve` and the wheel's own test
start cold interpreters on 0.23.0 and 0.32.0).
"""

from __future__ import annotations

from tests import children
from tests.helpers import applied_parts, run_fresh, wrappers_for


def test_spawned_child_is_patched_through_the_entry_point(vllm_version):
    report = run_fresh(children.spawned_child_report)
    assert report["imported_before_plugins"] is False
    assert report["parent_imported"] is False
    assert report["wrappers"] == wrappers_for(applied_parts(vllm_version))
    assert report["status"]["decision"] == "applied"
    assert report["exitcode"] == 0
