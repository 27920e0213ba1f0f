"""The fill on a GPU, in one command, on a machine with PyTorch and nothing else.

    python tools/gpu_check.py                  # CUDA, full sizes
    python tools/gpu_check.py --device cpu --quick   # what CI runs

Run as a script from a checkout: it loads the package's worker step
(``worker_step``, with ``fill``) from the checkout without the package's
``__init__``, so neither an installed package nor vLLM is needed (without
vLLM, Python's logging stands in for vLLM's logger). It builds caches the way
vLLM 0.33's allocator lays them out (one int8 backing buffer; per layer a
``[B, H, N, C]`` view, layer-outer, pages dense; attention split into kernel
blocks; Mamba layers as int8 pages), registers them with a worker that holds
what upstream's worker holds (``kv_caches``, ``fill_mean``, ``fill_std``),
and fills with the functions the patched worker runs (``fill_step``,
``fill_groups``: per group the layers' pages as one view, one write;
consecutive groups over the same pages written together), and checks:

- bytes: every case (bf16 kernel-split, float8 dtype, fp8 stored as uint8,
  int8 pages, compressed states), scattered blocks and one run of them,
  filled on the device equals the same fill on the CPU, byte for byte, and
  nothing outside the requested blocks moved;
- no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``) in
  a whole step whose fills are worked out in it, nor in the layer-by-layer
  fills, random ones included;
- the step's time against a memset of exactly the bytes it writes, what the
  host pays for it, its kernels (counted with the profiler; no copy from
  pageable memory) and its pages farthest apart (against the CPU's), at 1,
  16, 256 and 1024 requests of a 48-layer hybrid with
  Qwen3-Next-80B-at-TP=4 pages (536 KiB): from 256 requests a group's pages
  span more than 2 GiB, where CUDA would split a kernel whose offsets reach
  that far.

Exit status 1 when bytes differ, a fill synchronises or copies from pageable
memory; the timings and kernel counts are printed, for the README's table.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

PAGE_BYTES = 536 * 1024
"""Qwen3-Next-80B at TP=4: a linear-attention layer's state page."""
QUICK_PAGE_BYTES = 4096
LAYERS_PER_GROUP, GROUPS = 12, 4
"""One attention group and three linear-attention groups of 12 layers."""
ATTENTION_BLOCKS, STATE_BLOCKS = 8, 1
"""Per request: 8 attention blocks; one state block per linear group."""
PROMPT_TOKENS = 8 * 16
"""Each request's tokens to fill (the step reads only its block ids)."""
KERNEL_SPLIT = 2
REQUESTS = (1, 16, 256, 1024)
QUICK_REQUESTS = (1, 16)


def load_worker_step() -> ModuleType:
    """The package's ``worker_step`` from the checkout. The package's
    ``__init__`` is not run: it reads the installed distribution's metadata
    and registers import hooks, neither of which the fill needs."""
    package = ModuleType("vllm_kvfill_patch")
    package.__path__ = [str(Path(__file__).parents[1] / "vllm_kvfill_patch")]
    sys.modules["vllm_kvfill_patch"] = package
    try:
        import vllm.logger  # noqa: F401
    except ImportError:
        sys.modules["vllm"] = ModuleType("vllm")
        sys.modules["vllm.logger"] = logging_without_vllm()
    return importlib.import_module("vllm_kvfill_patch.worker_step")


def logging_without_vllm() -> ModuleType:
    """``vllm.logger`` where vLLM is not installed: Python's loggers, with the
    ``warning_once`` that vLLM's add."""
    module = ModuleType("vllm.logger")
    said: set[tuple] = set()

    def init_logger(name: str) -> Any:
        logger: Any = logging.getLogger(name)

        def warning_once(message: str, *args: object) -> None:
            if (message, args) not in said:
                said.add((message, args))
                logger.warning(message, *args)

        logger.warning_once = warning_once
        return logger

    module.init_logger = init_logger  # type: ignore[attr-defined]
    return module


worker_step = load_worker_step()
fill = importlib.import_module("vllm_kvfill_patch.fill")  # what worker_step runs


def registered(
    caches_by_group: dict[int, list[Any]],
    num_blocks: int,
    value: Any,
) -> tuple[SimpleNamespace, Any]:
    """A worker holding what upstream's worker holds when the patched step
    runs (its registered caches, the fill parameters), with the layout the
    step takes from its registration: `caches_by_group`, each a list of
    layers, in pools of `num_blocks` blocks, filled with `value`."""
    group_to_layers = {
        group: [f"group{group}.layer{layer}" for layer in range(len(caches))]
        for group, caches in caches_by_group.items()
    }
    kv_caches = {
        name: cache
        for group, caches in caches_by_group.items()
        for name, cache in zip(group_to_layers[group], caches, strict=True)
    }
    worker = SimpleNamespace(
        kv_caches=kv_caches, fill_mean=value.mean, fill_std=value.std
    )
    layout = worker_step.CacheLayout(
        num_blocks, value.encoding, group_to_layers, kv_caches=kv_caches
    )
    return worker, layout


def group_caches(
    buffer: torch.Tensor,
    num_blocks: int,
    page_bytes: int,
    dtype: torch.dtype,
    ratio: int,
) -> list[torch.Tensor]:
    """12 layer-outer views ``[B * ratio, H, N, C]`` of `dtype` over `buffer`
    (each layer its own region of `num_blocks` dense pages), as vLLM 0.33's
    allocator builds them for one group in layout LBNHC."""
    elements = page_bytes // dtype.itemsize
    heads, content = 2, 64
    tokens = elements // (heads * content * ratio)
    assert tokens * heads * content * ratio == elements, page_bytes
    values = buffer.view(dtype)
    shape = (num_blocks * ratio, heads, tokens, content)
    strides = (elements // ratio, content, heads * content, 1)  # tokens outside heads
    return [
        torch.as_strided(values, shape, strides, layer * num_blocks * elements)
        for layer in range(LAYERS_PER_GROUP)
    ]


CASES = {
    # name: (dtype of the views, kernel split, value, fp8 encoding of uint8 bytes)
    "bf16, kernel-split": (torch.bfloat16, KERNEL_SPLIT, 0.015, None),
    "float8 dtype": (torch.float8_e4m3fn, 1, 0.015, None),
    "fp8 stored as uint8": (torch.uint8, 1, 0.015, torch.float8_e4m3fn),
    "int8 pages (Mamba)": (torch.int8, 1, 0.015, None),
    "compressed states, split": (torch.bfloat16, 4, 0.5, None),
}


def fill_case(
    device: torch.device,
    case: str,
    page_bytes: int,
    block_ids: list[int],
    num_blocks: int,
) -> torch.Tensor:
    """One group of `case` filled at `block_ids`; the backing buffer, on the CPU."""
    dtype, ratio, mean, encoding = CASES[case]
    generator = torch.Generator().manual_seed(0)
    size = LAYERS_PER_GROUP * num_blocks * page_bytes
    host = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator)
    buffer = host.to(device)
    caches = group_caches(buffer, num_blocks, page_bytes, dtype, ratio)
    value = fill.FillValue(mean, 0.0, encoding)
    worker, layout = registered({0: caches}, num_blocks, value)
    worker_step.fill_groups(worker, layout, {0: block_ids})
    if block_ids:  # the group's layers as one view, as on vLLM 0.33's caches
        assert layout.pages_fills.by_group[0] is not None, case
    return buffer.cpu()


BLOCK_ID_CASES = {
    "scattered": [1, 2, 3, 7, 11, 12, 20, 23],
    "one run": [5, 6, 7],
}


def check_bytes(device: torch.device, page_bytes: int) -> bool:
    num_blocks = 24
    ok = True
    for case in CASES:
        for blocks, block_ids in BLOCK_ID_CASES.items():
            ok &= check_case(device, case, page_bytes, block_ids, num_blocks, blocks)
    return ok


def check_case(
    device: torch.device,
    case: str,
    page_bytes: int,
    block_ids: list[int],
    num_blocks: int,
    blocks: str,
) -> bool:
    on_device = fill_case(device, case, page_bytes, block_ids, num_blocks)
    on_cpu = fill_case(torch.device("cpu"), case, page_bytes, block_ids, num_blocks)
    untouched = fill_case(torch.device("cpu"), case, page_bytes, [], num_blocks)
    same = torch.equal(on_device, on_cpu)
    pages = on_cpu.view(LAYERS_PER_GROUP, num_blocks, page_bytes)
    before = untouched.view(LAYERS_PER_GROUP, num_blocks, page_bytes)
    others = [b for b in range(num_blocks) if b not in block_ids]
    outside_kept = torch.equal(pages[:, others], before[:, others])
    inside_written = not torch.equal(pages[:, block_ids], before[:, block_ids])
    good = same and outside_kept and inside_written
    print(
        f"bytes  {case + ', ' + blocks:<37} {'ok' if good else 'WRONG'} "
        f"(device = CPU: {same}, other blocks kept: {outside_kept}, "
        f"requested written: {inside_written})"
    )
    return good


UNWRITTEN = 0x55
"""The byte a step's buffer holds before the step: zeros (the Mamba pages'
fill) show against it."""


class Step:
    """A 48-layer hybrid's caches over one backing buffer, and one scheduler
    step of `requests` requests: per group its pages view and block ids."""

    def __init__(self, device: torch.device, requests: int, page_bytes: int) -> None:
        blocks_per_request = ATTENTION_BLOCKS + (GROUPS - 1) * STATE_BLOCKS
        self.num_blocks = 1 + requests * blocks_per_request
        self.page_bytes = page_bytes
        size = LAYERS_PER_GROUP * self.num_blocks * page_bytes
        self.buffer = torch.full((size,), UNWRITTEN, dtype=torch.int8, device=device)
        order = torch.randperm(
            self.num_blocks - 1, generator=torch.Generator().manual_seed(0)
        )
        free = (order + 1).tolist()
        # Per group, its layers and each request's block ids in it.
        self.caches = [
            group_caches(
                self.buffer, self.num_blocks, page_bytes, torch.bfloat16, KERNEL_SPLIT
            )
        ]
        self.caches += [
            group_caches(self.buffer, self.num_blocks, page_bytes, torch.int8, 1)
            for _ in range(GROUPS - 1)
        ]
        per_group = [ATTENTION_BLOCKS] + [STATE_BLOCKS] * (GROUPS - 1)
        self.requests = {
            f"request-{request}": (
                [[free.pop() for _ in range(count)] for count in per_group],
                PROMPT_TOKENS,
            )
            for request in range(requests)
        }
        self.block_ids = [
            [b for ids, _ in self.requests.values() for b in ids[group]]
            for group in range(GROUPS)
        ]
        self.filled_bytes = sum(
            len(ids) * LAYERS_PER_GROUP * page_bytes for ids in self.block_ids
        )
        self.value = fill.FillValue(0.015)
        self.worker, self.layout = registered(
            dict(enumerate(self.caches)), self.num_blocks, self.value
        )

    def run(self) -> None:
        """The patched worker's step: how each group is written is worked out
        at its first fill, as in a worker; the three linear-attention groups,
        pages of the same memory written alike, in one write."""
        worker_step.fill_step(self.worker, self.layout, self.requests)

    def far_pages_right(self) -> bool:
        """One step over an unwritten buffer, then the pages farthest apart
        compared with the CPU's fill: each group's lowest and highest block
        in the first and the last layer (from 256 requests, gigabytes past
        the buffer's start), and the null block's, left unwritten."""
        self.buffer.fill_(UNWRITTEN)
        self.run()
        layers = self.buffer.view(LAYERS_PER_GROUP, self.num_blocks, self.page_bytes)
        unwritten = torch.full((self.page_bytes,), UNWRITTEN, dtype=torch.int8)
        right = True
        for caches, block_ids in zip(self.caches, self.block_ids, strict=True):
            page = expected_page(caches[0].dtype, self.value, self.page_bytes)
            for layer in (0, LAYERS_PER_GROUP - 1):
                for block, expected in (
                    (min(block_ids), page),
                    (max(block_ids), page),
                    (fill.NULL_BLOCK_ID, unwritten),
                ):
                    right &= torch.equal(layers[layer, block].cpu(), expected)
        return right


def expected_page(dtype: torch.dtype, value: object, page_bytes: int) -> torch.Tensor:
    """A page of `dtype` filled with `value` (a ``fill.FillValue``) by the
    CPU, as its bytes."""
    pages = torch.zeros(2, 1, page_bytes, dtype=torch.int8).view(dtype)
    fill.fill_group_pages_(pages, fill.BlockSet([1], 2), value)
    return pages[1, 0].view(torch.int8)


def sync_cases(device: torch.device, page_bytes: int) -> dict[str, Callable]:
    """Steps that must not synchronise with the host, each registered anew so
    that how it is written is worked out in it (a group's first fill): a
    whole step, and layers filled one by one, random fills included (a
    random fill is never written as pages; list states never are)."""
    num_blocks = 24
    buffer = torch.zeros(
        LAYERS_PER_GROUP * num_blocks * QUICK_PAGE_BYTES,
        dtype=torch.int8,
        device=device,
    )

    def layer(dtype: torch.dtype) -> torch.Tensor:
        return group_caches(buffer, num_blocks, QUICK_PAGE_BYTES, dtype, 1)[0]

    def step(cache: Any, value: Any, blocks: str = "scattered") -> Callable:
        def run() -> None:
            worker, layout = registered({0: [cache]}, num_blocks, value)
            worker_step.fill_groups(worker, layout, {0: BLOCK_ID_CASES[blocks]})

        return run

    mamba = [
        torch.zeros(num_blocks, 3, 2048, device=device),
        torch.zeros(num_blocks, 8, 128, 128, device=device),
    ]
    constant, random = fill.FillValue(0.015), fill.FillValue(0.0, 1.0)
    random_fp8 = fill.FillValue(0.0, 1.0, torch.float8_e4m3fn)
    return {
        "a step of 16 requests, its fills worked out in it": (
            lambda: Step(device, 16, page_bytes).run()
        ),
        "constant, one layer (bf16)": step(layer(torch.bfloat16), constant),
        "random, one layer (bf16)": step(layer(torch.bfloat16), random),
        "random, one layer (bf16), one run": step(
            layer(torch.bfloat16), random, "one run"
        ),
        "random, one layer (fp8 stored as uint8)": step(layer(torch.uint8), random_fp8),
        "random, one layer (float8 dtype)": step(layer(torch.float8_e4m3fn), random),
        "random, Mamba states (fp32)": step(mamba, random),
    }


def check_no_sync(device: torch.device, page_bytes: int) -> bool:
    cases = sync_cases(device, page_bytes)
    if device.type != "cuda":
        for call in cases.values():
            call()
        print(f"sync   not a CUDA device: {len(cases)} cases ran, not checked")
        return True
    fill._signed_word_for.cache_clear()  # a first fill checks its word, too
    ok = True
    for case, call in cases.items():
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            call()
            print(f"sync   none: {case}")
        except Exception as exc:  # noqa: BLE001 - one run: report it, go on
            synchronised = isinstance(exc, RuntimeError) and "synchron" in str(exc)
            verdict = "SYNCHRONISED" if synchronised else "FAILED"
            print(f"sync   {verdict}: {case}: {exc!r}")
            ok = False
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(device)
    return ok


def kernels_in(step: Step, device: torch.device) -> list[str]:
    """The names of the kernels (and copies) one run of `step` launches."""
    from torch.profiler import ProfilerActivity, profile

    step.run()  # warm-up
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.run()
        torch.cuda.synchronize(device)
    return [
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    ]


def timed(
    call: Callable[[], object], device: torch.device, repeats: int, wait: bool = True
) -> float:
    """The median time of `call`; with `wait`, until the device has done it,
    else until it returns (what the host pays: on a GPU the launches)."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if wait and device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sorted(times)[len(times) // 2]


def time_steps(
    device: torch.device, page_bytes: int, requests: tuple, repeats: int
) -> bool:
    """The table; False where the far pages are wrong or the index was copied
    from pageable memory (a hidden synchronisation)."""
    print(
        f"\n| requests | filled GiB | memset ms | step ms | step/memset | step host ms "
        f"| kernels per step ({GROUPS} groups) | far pages |  "
        f"(pages {page_bytes // 1024} KiB, {device})"
    )
    print("|---|---|---|---|---|---|---|---|")
    ok = True
    names: set[str] = set()
    for count in requests:
        row, kernels, row_ok = time_row(device, page_bytes, count, repeats)
        print(row, flush=True)
        names.update(kernels)
        ok &= row_ok
    if names:
        print(f"kernels (copies of the index included): {sorted(names)}")
    pageable = sorted(name for name in names if "Pageable" in name)
    if pageable:
        print(f"copies from pageable memory (a host synchronisation): {pageable}")
    return ok and not pageable


def time_row(
    device: torch.device, page_bytes: int, count: int, repeats: int
) -> tuple[str, list[str], bool]:
    step = Step(device, count, page_bytes)
    # The same number of bytes, contiguous, in the caches' own buffer: at
    # 1024 requests the caches take half an H200.
    memset_view = step.buffer[: step.filled_bytes]
    memset = timed(lambda: memset_view.fill_(1), device, repeats)
    step_time = timed(step.run, device, repeats)
    host_time = timed(step.run, device, repeats, wait=False)
    kernels = kernels_in(step, device) if device.type == "cuda" else []
    if device.type != "cuda":
        counted = "-"
    else:  # none seen: the profiler (CUPTI) is missing, not the kernels
        counted = str(len(kernels)) if kernels else "? (no profiler)"
    far_right = step.far_pages_right()
    row = (
        f"| {count} | {step.filled_bytes / 2**30:.2f} | {memset * 1e3:.3f} "
        f"| {step_time * 1e3:.3f} | {step_time / memset:.2f}x "
        f"| {host_time * 1e3:.3f} | {counted} | {'ok' if far_right else 'WRONG'} |"
    )
    return row, kernels, far_right


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="4 KiB pages, 1 and 16 requests"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--requests", type=int, nargs="+",
        help=f"the table's step sizes (default {REQUESTS}; --quick: {QUICK_REQUESTS})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    requests = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    device = torch.device(args.device)
    page_bytes = QUICK_PAGE_BYTES if args.quick else PAGE_BYTES
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {name}")
    ok = check_bytes(device, QUICK_PAGE_BYTES)
    ok &= check_no_sync(device, page_bytes)
    ok &= time_steps(device, page_bytes, tuple(requests), args.repeats)
    print("\nresult:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
