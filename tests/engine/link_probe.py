"""Runs the tiny hybrid model on a real in-process vLLM engine with the link
model, step by step: ``main(options)``, in a fresh process
(``helpers.run_probe``'s zygote), returns a JSON-able report.

Options: ``connector_options`` (the connector's, the link's among them),
``failure_policy`` (vLLM's ``kv_load_failure_policy``; its default
unset), ``scenarios``, run in turn on one engine: ``abort`` (one request
aborted while its KV is in flight), ``one_at_a_time`` (``requests``
requests, each alone, to its end), ``together`` (``requests`` requests added
at once).

The report: every scheduler step (``steps``: its monotonic time, what it
scheduled, the requests waiting for their KV), each request's transfer bytes
(``transfer_bytes``), vLLM's own timestamps per request (``timestamps``:
queued, scheduled, first token, from ``RequestOutput.metrics``; monotonic,
the scheduler's clock in one process), how each request finished
(``finished``), vLLM's metrics at the end (``metrics``: each counter's and
histogram's value, and its sum, by name and labels) after its periodic log
line was written, and the KV blocks free after every scenario
(``free_after``); for ``abort`` the KV blocks free before, while in flight
and after (``free_blocks``).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from tests import tiny_model

PROMPT = 100
OUTPUT = 4


def record_steps(scheduler: Any, steps: list[dict]) -> None:
    """After each ``schedule()``, what it scheduled and who waits for KV."""
    from vllm.v1.request import RequestStatus

    schedule = scheduler.schedule

    def traced(*args, **kwargs):
        output = schedule(*args, **kwargs)
        waiting = [
            rid
            for rid, request in scheduler.requests.items()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        steps.append(
            {
                "t": time.monotonic(),
                "scheduled": dict(output.num_scheduled_tokens),
                "waiting_for_kv": waiting,
            }
        )
        return output

    scheduler.schedule = traced


def record_reports(scheduler: Any, reports: list[dict]) -> None:
    """Each time the workers' aggregated output reaches the scheduler: the
    transfers every rank reported finished in it."""
    update = scheduler._update_from_kv_xfer_finished

    def traced(kv_connector_output):
        if kv_connector_output.finished_recving:
            reports.append(
                {
                    "t": time.monotonic(),
                    "finished": sorted(kv_connector_output.finished_recving),
                }
            )
        return update(kv_connector_output)

    scheduler._update_from_kv_xfer_finished = traced


def record_transfers(link: Any, transfer_bytes: dict) -> None:
    admit = link.admit

    def traced(fills):
        transfer_bytes.update(
            {rid: link.bytes_of(block_ids) for rid, (block_ids, _) in fills.items()}
        )
        return admit(fills)

    link.admit = traced


def run_to_end(engine: Any, outputs: dict) -> None:
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output


def timestamps(output: Any) -> dict:
    metrics = output.metrics
    return {
        "queued": metrics.queued_ts,
        "scheduled": metrics.scheduled_ts,
        "first_token": metrics.first_token_ts,
        "tokens": len(output.outputs[0].token_ids),
    }


def main(options: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    import vllm_kvfill_patch

    report: dict = {"steps": [], "reports": [], "transfer_bytes": {}, "timestamps": {}}
    with tempfile.TemporaryDirectory() as scratch:
        model = tiny_model.write_tiny_model(Path(scratch) / "tiny-qwen3-next")
        transfer = {
            **tiny_model.DECODE_BENCH_CONNECTOR,
            "kv_connector_extra_config": options["connector_options"],
        }
        if options.get("failure_policy"):
            transfer["kv_load_failure_policy"] = options["failure_policy"]
        llm = LLM(
            **tiny_model.engine_arguments(
                model,
                kv_transfer_config=transfer,
                distributed_executor_backend="uni",
                disable_log_stats=False,
            )
        )
        engine = llm.llm_engine
        scheduler = engine.engine_core.engine_core.scheduler
        record_steps(scheduler, report["steps"])
        record_reports(scheduler, report["reports"])
        link = scheduler.connector.connector_scheduler._kvfill_link
        record_transfers(link, report["transfer_bytes"])
        report["bytes_per_block"] = list(link.bytes_per_block)
        report["block_sizes"] = [
            group.kv_cache_spec.block_size
            for group in scheduler.kv_cache_config.kv_cache_groups
        ]
        sampling = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
        pool = scheduler.kv_cache_manager.block_pool
        free_at_start = pool.get_num_free_blocks()
        prompts = tiny_model.prompts(PROMPT, options.get("requests", 1))
        outputs: dict = {}
        for scenario in options["scenarios"]:
            if scenario == "abort":
                report["free_blocks"] = abort_in_flight(engine, scheduler, prompts[0])
                continue
            for index, prompt in enumerate(prompts):
                engine.add_request(f"{scenario}-{index}", prompt, sampling)
                if scenario == "one_at_a_time":
                    run_to_end(engine, outputs)
            run_to_end(engine, outputs)
        report["timestamps"] = {rid: timestamps(o) for rid, o in outputs.items()}
        report["finished"] = {
            rid: o.outputs[0].finish_reason for rid, o in outputs.items()
        }
        report["free_after"] = pool.get_num_free_blocks()
        report["free_at_start"] = free_at_start
        engine.do_log_stats()
        report["metrics"] = metric_values(llm.get_metrics())
        report["status"] = vllm_kvfill_patch.status().reason
    return report


def metric_values(metrics: list) -> dict[str, float]:
    """vLLM's metrics by name and labels: a counter's or gauge's value, a
    histogram's count (and its sum under ``<name>_sum``)."""
    values: dict[str, float] = {}
    for metric in metrics:
        labels = ",".join(f"{k}={v}" for k, v in sorted(metric.labels.items()))
        key = f"{metric.name}{{{labels}}}"
        if hasattr(metric, "count"):
            values[key] = metric.count
            values[f"{metric.name}_sum{{{labels}}}"] = metric.sum
        elif hasattr(metric, "value"):
            values[key] = metric.value
    return values


def abort_in_flight(engine: Any, scheduler: Any, prompt: dict) -> dict:
    """Free blocks before, while the request waits for its KV, and after
    it was aborted there and the engine ran on."""
    from vllm import SamplingParams

    pool = scheduler.kv_cache_manager.block_pool
    free = {"before": pool.get_num_free_blocks()}
    engine.add_request("aborted", prompt, SamplingParams(max_tokens=OUTPUT))
    engine.step()
    free["in_flight"] = pool.get_num_free_blocks()
    engine.abort_request(["aborted"])
    for _ in range(5):
        engine.step()
    free["after"] = pool.get_num_free_blocks()
    free["still_known"] = "aborted" in scheduler.requests
    return free
