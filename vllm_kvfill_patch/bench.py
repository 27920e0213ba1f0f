"""Benchmark: the patched fill against upstream's and against the physical limit.

    python -m vllm_kvfill_patch.bench [--device cuda] [--repeats N]

Upstream's implementation is the installed vLLM's own ``_fill_blocks`` (the
original function, unwrapped), called on a worker holding one layer. Run it
on vLLM 0.24 - 0.29 to see both upstream paths: the attention fill (a
temporary the size of the filled region, then a scatter) and #45080's
whole-tensor state fill; on 0.11.1 - 0.23 the state case crashes upstream.
The limit is an in-place fill (or in-place sampling) of a contiguous buffer
of the same bytes. Times are medians; memory is the peak allocated during
one call, beyond what was allocated before it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import wrapt

import vllm_kvfill_patch
from vllm_kvfill_patch.gating import CONNECTOR_MODULE

MIB = 1024 * 1024

ATTENTION_BLOCKS = 4096
ATTENTION_BLOCK_SHAPE = (2, 16, 8, 128)  # K/V, block_size, heads, head_dim
STATE_SHAPES = ((3, 2048), (8, 128, 128))  # conv, recurrent (Qwen3-Next-like, TP=4)


@dataclass
class Case:
    name: str
    make_cache: Callable[[torch.device], object]
    block_ids: list[int]
    filled_bytes: int
    std: float
    num_blocks: int
    dtype: torch.dtype


@dataclass
class Measured:
    seconds: float | None
    peak_bytes: int | None
    error: str | None = None


def attention_case(name: str, block_ids: list[int], std: float) -> Case:
    block_bytes = torch.Size(ATTENTION_BLOCK_SHAPE).numel() * 2

    def make_cache(device):
        return torch.zeros(
            (ATTENTION_BLOCKS, *ATTENTION_BLOCK_SHAPE),
            dtype=torch.bfloat16,
            device=device,
        )

    return Case(
        name,
        make_cache,
        block_ids,
        len(set(block_ids)) * block_bytes,
        std,
        ATTENTION_BLOCKS,
        torch.bfloat16,
    )


def state_case(num_blocks: int) -> Case:
    """One request's state block in a hybrid pool of `num_blocks` pages."""
    page_elements = sum(torch.Size(s).numel() for s in STATE_SHAPES)

    def make_cache(device):
        pool = torch.zeros(num_blocks * page_elements, device=device)
        states, offset = [], 0
        for shape in STATE_SHAPES:
            strides = [torch.Size(shape[i + 1 :]).numel() for i in range(len(shape))]
            states.append(
                torch.as_strided(
                    pool, (num_blocks, *shape), (page_elements, *strides), offset
                )
            )
            offset += torch.Size(shape).numel()
        return states

    pool_mib = num_blocks * page_elements * 4 / MIB
    return Case(
        f"state, 1 request, {pool_mib:.0f} MiB pool",
        make_cache,
        [num_blocks // 2],
        page_elements * 4,
        0.0,
        num_blocks,
        torch.float32,
    )


def cases() -> list[Case]:
    generator = torch.Generator().manual_seed(0)
    scattered = (
        torch.randperm(ATTENTION_BLOCKS - 1, generator=generator)[:256] + 1
    ).tolist()
    consecutive = list(range(1, 257))
    return [
        attention_case("attention, 256 consecutive, constant", consecutive, 0.0),
        attention_case("attention, 256 scattered, constant", scattered, 0.0),
        attention_case("attention, 256 consecutive, random", consecutive, 0.1),
        attention_case("attention, 256 scattered, random", scattered, 0.1),
        state_case(128),
        state_case(1024),
    ]


def upstream_fill_blocks() -> tuple[type, Callable]:
    """The installed vLLM's worker class and its original `_fill_blocks`."""
    import importlib

    module = importlib.import_module(CONNECTOR_MODULE)
    worker_cls = module.DecodeBenchConnectorWorker
    chain = list(wrapt.wrapper_chain(worker_cls.__dict__["_fill_blocks"]))
    return worker_cls, chain[-1]


def one_layer_worker(worker_cls: type, cache, case: Case, mean: float):
    from vllm_kvfill_patch.replacement import LAYOUT_ATTR, CacheLayout

    worker = object.__new__(worker_cls)
    worker.kv_caches = {"layer": cache}
    worker.group_to_layers = {0: ["layer"]}
    worker.fill_mean = mean
    worker.fill_std = case.std
    setattr(worker, LAYOUT_ATTR, CacheLayout(case.num_blocks, None))
    return worker


def measure(call: Callable[[], None], device: torch.device, repeats: int) -> Measured:
    try:
        call()  # warm-up, and the first error
    except Exception as exc:  # noqa: BLE001 - upstream may crash; report it
        return Measured(None, None, f"{type(exc).__name__}: {exc}")
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return Measured(statistics.median(times), peak_allocated(call, device))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_allocated(call: Callable[[], None], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    # Allocations are charged to the op that made them, frees to "[memory]".
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def run_case(case: Case, device: torch.device, repeats: int, mean: float) -> dict:
    worker_cls, upstream = upstream_fill_blocks()
    from vllm_kvfill_patch.replacement import fill_blocks

    limit_buffer = torch.empty(case.filled_bytes, dtype=torch.uint8, device=device)
    limit_view = limit_buffer.view(case.dtype)

    def limit():
        if case.std > 0:
            limit_view.normal_(mean, case.std)
        else:
            limit_view.fill_(mean)

    cache = case.make_cache(device)
    worker = one_layer_worker(worker_cls, cache, case, mean)
    tokens = 16 * len(case.block_ids)
    result = {
        "limit": measure(limit, device, repeats),
        "upstream": measure(
            lambda: upstream(worker, 0, case.block_ids, tokens), device, repeats
        ),
        "overlay": measure(
            lambda: fill_blocks(None, worker, (0, case.block_ids, tokens), {}),
            device,
            repeats,
        ),
    }
    del cache, limit_buffer
    return result


def format_row(case: Case, result: dict) -> str:
    limit, upstream, overlay = result["limit"], result["upstream"], result["overlay"]

    def ms(m: Measured) -> str:
        return "crash" if m.seconds is None else f"{m.seconds * 1e3:.3f}"

    def mib(m: Measured) -> str:
        return "-" if m.peak_bytes is None else f"{m.peak_bytes / MIB:.1f}"

    vs_limit = overlay.seconds / limit.seconds
    vs_upstream = (
        "-"
        if upstream.seconds is None
        else f"{overlay.seconds / upstream.seconds:.2f}x"
    )
    cells = [
        case.name,
        f"{case.filled_bytes / MIB:.2f}",
        ms(limit),
        ms(upstream),
        ms(overlay),
        f"{vs_limit:.2f}x",
        vs_upstream,
        mib(upstream),
        mib(overlay),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--mean", type=float, default=0.015)
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    vllm_kvfill_patch.apply()
    _, upstream = upstream_fill_blocks()
    status = vllm_kvfill_patch.status()
    print(
        f"vLLM {status.vllm_version}; patch {status.decision.value}; "
        f"upstream = {upstream.__module__}.{upstream.__qualname__}; device {device}; "
        f"torch {torch.__version__}; {torch.get_num_threads()} threads; "
        f"median of {args.repeats}"
    )
    print(
        "| case | filled MiB | limit ms | upstream ms | overlay ms | overlay/limit "
        "| overlay/upstream | upstream peak MiB | overlay peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case in cases():
        print(
            format_row(case, run_case(case, device, args.repeats, args.mean)),
            flush=True,
        )


if __name__ == "__main__":
    main()
