"""The fill on a GPU, in one command, on a machine with PyTorch and nothing else.

    python tools/gpu_check.py --table gpu_check.md   # CUDA, full sizes
    python tools/gpu_check.py --device cpu --quick    # what CI runs

Run as a script from a checkout: it loads the package's worker step
(``worker_step``, with ``fill``) from the checkout without the package's
``__init__``, so neither an installed package nor vLLM is needed (without
vLLM, Python's logging stands in for vLLM's logger), and drives the functions
the patched worker runs (``fill_step``, ``fill_groups``) on caches laid out as
vLLM lays them out, over one backing buffer of random bytes per path.

Paths: every way the worker's step can write (`PATHS`): a group's pages at
once (vLLM 0.33's allocator), layer by layer, list / tuple states over a
pool shared with attention (a transposed conv state and an fp32 SSM state),
kernel-split single tensors, FlashAttention's ``(2, num_blocks, ...)``, MLA's
``(num_blocks, tokens, 576)``, bf16 / fp16 / fp32, float8 dtypes and fp8
stored as uint8; each with a constant and a random fill. Per path:

- bytes: many steps back to back (on CUDA on a stream of its own, no
  synchronisation between them), each with other block ids (runs, scattered,
  the null block and ids outside the pool among them) and, step by step,
  values from two workers over the same caches; then compared byte for byte
  with the same steps replayed on the CPU (a random fill's replay copies the
  device's samples), with an independent model of the bytes each step must
  write (the rows of its blocks, as the path lays them out): nothing else
  moved, a constant is exactly its bytes, random values finite and in range
  (no fp8 NaN byte);
- on CUDA: no host synchronisation (``set_sync_debug_mode("error")`` over
  every step), the host not blocked (a long device sleep queued before a
  step: the step returns long before it ends), in this warm process and in
  a cold one; allocator calls per warm step (``memory_stats``); a CUDA graph
  that reads a block, replayed after a fill, sees the fill; a fill asked for
  while a graph is being captured is not issued; the link model's arrivals
  filled on a stream of their own and reported once their fill is done.

Then the step's time against a memset of the bytes it writes, constant and
random, at 1, 16, 256 and 1024 requests of a 48-layer hybrid with
Qwen3-Next-80B-at-TP=4 pages (536 KiB; the 1024 row needs about 71 GiB):
the step of ``tools/step_rig.py``, timed by ``tools/timing.py``, as
``tools/bench.py`` times it.
``--table FILE`` writes both tables as Markdown. Exit status 1 when any
check fails.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

if not __package__:  # run as a script: the checkout's root holds `tools`
    sys.path.insert(0, str(Path(__file__).parents[1]))

from tools import step_rig
from tools.step_rig import view_at
from tools.timing import (
    MIN_MEASURED_SECONDS,
    Timing,
    against,
    measure_in_turn,
    seconds,
)

PAGE_BYTES = 536 * 1024
"""Qwen3-Next-80B at TP=4: a linear-attention layer's state page."""
QUICK_PAGE_BYTES = 4096
REQUESTS = (1, 16, 256, 1024)
QUICK_REQUESTS = (1, 16)
BLOCK_TOKENS = 16
"""Tokens per KV-manager block in every path."""
CONSTANTS = (0.015, -1.5)
"""The two workers' constants, alternating step by step."""
RANDOMS = ((0.0, 1.0), (0.5, 0.1))
"""The two workers' (mean, std) of the random fills."""
SLEEP_SECONDS = 0.5
"""The device sleep a step is queued behind in the host-blocking check."""


@functools.cache
def worker_step() -> ModuleType:
    """The package's ``worker_step`` from the checkout, loaded at its first
    use: importing this module changes no module. The package's
    ``__init__`` is not run: it imports wrapt and registers an import hook
    on vLLM's connector, neither of which the fill needs (a bare GPU
    machine has PyTorch alone). Without vLLM, Python's logging stands in
    for ``vllm.logger``."""
    package = ModuleType("vllm_kvfill_patch")
    package.__path__ = [str(Path(__file__).parents[1] / "vllm_kvfill_patch")]
    sys.modules["vllm_kvfill_patch"] = package
    try:
        import vllm.logger  # noqa: F401
    except ImportError:
        sys.modules["vllm"] = ModuleType("vllm")
        sys.modules["vllm.logger"] = logging_without_vllm()
    return importlib.import_module("vllm_kvfill_patch.worker_step")


def fill() -> ModuleType:
    """The package's ``fill``, which `worker_step` runs."""
    worker_step()
    return importlib.import_module("vllm_kvfill_patch.fill")


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


# The paths: caches over one backing buffer, and where each block's rows are.


@dataclass
class Cache:
    """One layer's cache: a tensor, or (`states_as`) a list / tuple of state
    tensors; `tensors` its views, each with its blocks `ratio` rows each
    along `block_dim` (the independent model of what a block is)."""

    group: int
    tensors: list[torch.Tensor]
    block_dim: int = 0
    ratio: int = 1
    states_as: type | None = None
    offsets: list[torch.Tensor] = field(default_factory=list)
    """Per tensor, its elements' first bytes, a row per block row (the
    model's, worked out once)."""

    @property
    def registered(self) -> Any:
        if self.states_as is None:
            return self.tensors[0]
        return self.states_as(self.tensors)


@dataclass
class Rig:
    """A path's caches over `buffer` (int8), in pools of `num_blocks`."""

    buffer: torch.Tensor
    caches: list[Cache]
    num_blocks: int
    encoding: torch.dtype | None = None
    """The fp8 format uint8 caches hold."""
    groups: int = 1


@dataclass(frozen=True)
class PathSpec:
    """How to lay out a path's caches: `build(buffer_of, num_blocks)`, where
    `buffer_of(size)` gives the backing buffer."""

    build: Callable[[Callable[[int], torch.Tensor], int], Rig]
    pages_at_once: bool = False
    """A fill writes the group's pages in one view (asserted)."""


def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def pages_rig(
    dtype: torch.dtype, ratio: int = 1, encoding: torch.dtype | None = None
) -> Callable:
    """vLLM 0.33's allocator: layer-outer ``[B * ratio, H, N, C]`` views, heads
    and tokens permuted within each dense page, 4 layers of one group."""

    def build(buffer_of: Callable, num_blocks: int) -> Rig:
        heads, content, tokens = 2, 32, BLOCK_TOKENS // ratio
        page = heads * content * tokens * ratio
        buffer = buffer_of(4 * num_blocks * page * dtype.itemsize)
        shape = (num_blocks * ratio, heads, tokens, content)
        strides = (page // ratio, content, heads * content, 1)
        caches = [
            Cache(
                0,
                [
                    view_at(
                        buffer,
                        dtype,
                        shape,
                        strides,
                        layer * num_blocks * page * dtype.itemsize,
                    )
                ],
                0,
                ratio,
            )
            for layer in range(4)
        ]
        return Rig(buffer, caches, num_blocks, encoding)

    return build


def layers_rig(
    dtype: torch.dtype,
    row: tuple,
    ratio: int = 1,
    kv_first: bool = False,
    encoding: torch.dtype | None = None,
) -> Callable:
    """3 layers, each a tensor ``(N * ratio, *row)`` (``(2, N * ratio, *row)``
    with `kv_first`), at uneven offsets in one buffer: filled layer by layer."""

    def build(buffer_of: Callable, num_blocks: int) -> Rig:
        shape = (num_blocks * ratio, *row)
        if kv_first:
            shape = (2, *shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        gaps = [0, 64, 192]  # not a constant stride: no pages view
        buffer = buffer_of(3 * nbytes + sum(gaps))
        caches, at = [], 0
        for gap in gaps:
            at += gap
            view = view_at(buffer, dtype, shape, _contiguous_strides(shape), at)
            caches.append(Cache(0, [view], 1 if kv_first else 0, ratio))
            at += nbytes
        return Rig(buffer, caches, num_blocks, encoding)

    return build


CONV, SSM = (64, 3), (2, 16, 16)
"""A linear-attention layer's states: the conv state (channels, width - 1),
stored transposed (width outermost); the SSM state in fp32."""


def states_rig(states_as: type, conv_dtype: torch.dtype = torch.bfloat16) -> Callable:
    """Two layer slots over pages shared by an attention layer (group 0,
    bf16) and a linear-attention layer (group 1): a transposed conv state and
    an fp32 SSM state at the start of each page, padding after them."""

    def build(buffer_of: Callable, num_blocks: int) -> Rig:
        conv_bytes = CONV[0] * CONV[1] * conv_dtype.itemsize
        ssm_bytes = torch.Size(SSM).numel() * 4
        page = 2 * BLOCK_TOKENS * 2 * 32 * 2  # the attention page, bf16
        assert conv_bytes + ssm_bytes < page
        buffer = buffer_of(2 * num_blocks * page)
        caches = []
        for slot in range(2):
            base = slot * num_blocks * page
            attention = (num_blocks, 2, BLOCK_TOKENS, 2, 32)
            strides = (page // 2, *_contiguous_strides(attention)[1:])
            caches.append(
                Cache(0, [view_at(buffer, torch.bfloat16, attention, strides, base)])
            )
            channels, width = CONV
            conv = view_at(
                buffer,
                conv_dtype,
                (num_blocks, channels, width),
                (page // conv_dtype.itemsize, 1, channels),
                base,
            )
            ssm_strides = (page // 4, *_contiguous_strides(SSM))
            ssm = view_at(
                buffer,
                torch.float32,
                (num_blocks, *SSM),
                ssm_strides,
                base + conv_bytes,
            )
            caches.append(Cache(1, [conv, ssm], states_as=states_as))
        return Rig(buffer, caches, num_blocks, groups=2)

    return build


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ATTENTION_ROW = (BLOCK_TOKENS, 2, 32)
PATHS: dict[str, PathSpec] = {
    "pages at once, bf16, kernel-split": PathSpec(pages_rig(torch.bfloat16, 2), True),
    "pages at once, fp16": PathSpec(pages_rig(torch.float16), True),
    "pages at once, fp32": PathSpec(pages_rig(torch.float32), True),
    "pages at once, float8_e4m3fn": PathSpec(pages_rig(E4M3), True),
    "pages at once, fp8 e4m3fn as uint8": PathSpec(
        pages_rig(torch.uint8, encoding=E4M3), True
    ),
    "pages at once, int8 Mamba pages": PathSpec(pages_rig(torch.int8), True),
    "pages at once, compressed, split 4": PathSpec(pages_rig(torch.bfloat16, 4), True),
    "per layer, bf16": PathSpec(layers_rig(torch.bfloat16, ATTENTION_ROW)),
    "per layer, fp16": PathSpec(layers_rig(torch.float16, ATTENTION_ROW)),
    "per layer, fp32": PathSpec(layers_rig(torch.float32, ATTENTION_ROW)),
    "per layer, float8_e4m3fn": PathSpec(layers_rig(E4M3, ATTENTION_ROW)),
    "per layer, float8_e5m2": PathSpec(layers_rig(E5M2, ATTENTION_ROW)),
    "per layer, fp8 e4m3fn as uint8": PathSpec(
        layers_rig(torch.uint8, ATTENTION_ROW, encoding=E4M3)
    ),
    "per layer, fp8 e5m2 as uint8": PathSpec(
        layers_rig(torch.uint8, ATTENTION_ROW, encoding=E5M2)
    ),
    "kernel-split tensor, bf16, split 2": PathSpec(
        layers_rig(torch.bfloat16, (8, 2, 32), ratio=2)
    ),
    "kernel-split tensor, fp8 as uint8, split 4": PathSpec(
        layers_rig(torch.uint8, (4, 2, 32), ratio=4, encoding=E4M3)
    ),
    "(2, N, ...) K/V first, bf16": PathSpec(
        layers_rig(torch.bfloat16, ATTENTION_ROW, kv_first=True)
    ),
    "(2, N * 2, ...) K/V first, split 2": PathSpec(
        layers_rig(torch.bfloat16, (8, 2, 32), ratio=2, kv_first=True)
    ),
    "MLA (N, t, 576), bf16": PathSpec(layers_rig(torch.bfloat16, (BLOCK_TOKENS, 576))),
    "MLA (N, t, 576), fp8 as uint8": PathSpec(
        layers_rig(torch.uint8, (BLOCK_TOKENS, 576), encoding=E4M3)
    ),
    "list states + attention, shared pool": PathSpec(states_rig(list)),
    "tuple states + attention, fp32 conv": PathSpec(states_rig(tuple, torch.float32)),
}


# The independent model: which bytes a step writes, and what.


def element_bytes(view: torch.Tensor) -> torch.Tensor:
    """Per element of `view` (over an int8 buffer), the offset of its first
    byte in the buffer: the same view over the buffer's element numbers."""
    numbers = torch.arange(view.untyped_storage().nbytes() // view.itemsize)
    at = torch.as_strided(numbers, view.shape, view.stride(), view.storage_offset())
    return at * view.itemsize


def block_bytes(cache: Cache, block: int) -> list[torch.Tensor]:
    """The byte offsets of `block`'s rows in each of `cache`'s tensors."""
    if not cache.offsets:
        for tensor in cache.tensors:
            rows = element_bytes(tensor.cpu()).movedim(cache.block_dim, 0)
            cache.offsets.append(rows.reshape(rows.shape[0], -1))
    found = []
    for tensor, offsets in zip(cache.tensors, cache.offsets, strict=True):
        first = offsets[block * cache.ratio : (block + 1) * cache.ratio].flatten()
        found.append((first[:, None] + torch.arange(tensor.itemsize)).flatten())
    return found


def constant_bytes(dtype: torch.dtype, encoding: Any, mean: float) -> torch.Tensor:
    """The bytes of one element holding `mean` as the fill writes it."""
    if dtype == torch.uint8 and encoding is not None:
        dtype = encoding
    if not dtype.is_floating_point:
        return torch.zeros(dtype.itemsize, dtype=torch.uint8)
    finfo = torch.finfo(dtype)
    clamped = min(max(mean, finfo.min), finfo.max)
    return torch.tensor([clamped], dtype=torch.float32).to(dtype).view(torch.uint8)


@dataclass
class Expected:
    """What the steps must leave: `bytes` (a constant's, exactly; random
    values' bytes are the original's), which bytes some step `written`, and
    the tensor that wrote each byte last (`owner`, -1: none)."""

    bytes: torch.Tensor
    written: torch.Tensor
    owner: torch.Tensor
    sampled: set[int] = field(default_factory=set)
    """The tensors (by number) that got random values."""

    @property
    def random_bytes(self) -> torch.Tensor:
        mask = torch.zeros_like(self.written)
        for number in self.sampled:
            mask |= self.owner == number
        return mask


def expected_after(
    rig: Rig, original: torch.Tensor, steps: list, values: list, random: bool
) -> Expected:
    """The steps replayed on the model (CPU), from the `original` bytes: each
    step's valid blocks, per group, every tensor's rows of them, in order."""
    owner = torch.full(original.shape, -1, dtype=torch.int32)
    expected = Expected(original.clone(), owner >= 0, owner)
    tensors = [(c, p, t) for c in rig.caches for p, t in enumerate(c.tensors)]
    for step, block_ids in enumerate(steps):
        mean = values[step % 2][0]
        for number, (cache, position, tensor) in enumerate(tensors):
            valid = {b for b in block_ids[cache.group] if 0 < b < rig.num_blocks}
            for block in sorted(valid):
                at = block_bytes(cache, block)[position]
                expected.written[at] = True
                expected.owner[at] = number
                if random and _floating(tensor.dtype, rig.encoding):
                    expected.sampled.add(number)
                    continue
                pattern = constant_bytes(tensor.dtype, rig.encoding, mean)
                expected.bytes[at] = pattern.repeat(at.numel() // pattern.numel())
    return expected


def _floating(dtype: torch.dtype, encoding: Any) -> bool:
    return dtype.is_floating_point or (dtype == torch.uint8 and encoding is not None)


def random_values_in_range(rig: Rig, result: torch.Tensor, expected: Expected) -> bool:
    """The elements holding random values, each read as its own tensor's
    dtype, are finite and within its range (so no fp8 NaN byte)."""
    tensors = [t for cache in rig.caches for t in cache.tensors]
    for number in expected.sampled:
        tensor = tensors[number]
        dtype = tensor.dtype
        if dtype == torch.uint8 and rig.encoding is not None:
            dtype = rig.encoding
        at = element_bytes(tensor.cpu()).flatten()
        at = at[expected.owner[at] == number]
        raw = result[at[:, None] + torch.arange(dtype.itemsize)]
        if not torch.isfinite(raw.contiguous().view(dtype).float()).all():
            return False
    return True


# Running a path's steps.


def step_block_ids(rig: Rig, count: int, seed: int) -> list[list[list[int]]]:
    """`count` steps' block ids per group: disjoint between groups (as the
    allocator hands them out), a run and scattered ids, now and then the
    null block, an id past the pool and a negative one (never written)."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for step in range(count):
        order = (torch.randperm(rig.num_blocks - 1, generator=generator) + 1).tolist()
        per_group = []
        for _ in range(rig.groups):
            take = 1 + int(
                torch.randint(rig.num_blocks // 3, (1,), generator=generator)
            )
            ids = [order.pop() for _ in range(min(take, len(order) - 1))]
            if step % 3 == 0 and order:  # a run
                start = order.pop()
                ids += [b for b in range(start, start + 4) if b in order]
            if step % 4 == 1:
                ids += [0, rig.num_blocks, -1, ids[0] if ids else 1]
            per_group.append(ids)
        steps.append(per_group)
    return steps


def workers_for(
    rig: Rig, random: bool, noise: list | None = None
) -> list[tuple[Any, Any]]:
    """Two workers over `rig`'s caches (two registrations of the same
    caches), with the two values of `CONSTANTS` or `RANDOMS` (and `noise`,
    their samples, where given)."""
    kv_caches = {f"layer{i}": cache.registered for i, cache in enumerate(rig.caches)}
    group_to_layers: dict[int, list[str]] = {}
    for i, cache in enumerate(rig.caches):
        group_to_layers.setdefault(cache.group, []).append(f"layer{i}")
    pairs = []
    values = RANDOMS if random else [(c, 0.0) for c in CONSTANTS]
    for index, (mean, std) in enumerate(values):
        worker = SimpleNamespace(kv_caches=kv_caches, fill_mean=mean, fill_std=std)
        layout = worker_step().CacheLayout(
            rig.num_blocks,
            rig.encoding,
            group_to_layers,
            dict.fromkeys(group_to_layers, BLOCK_TOKENS),
            kv_caches,
            noise=fill().NoiseBank() if noise is None else noise[index],
        )
        pairs.append((worker, layout))
    return pairs


def run_steps(pairs: list, steps: list) -> None:
    """The steps, back to back, worker by worker in turn."""
    for index, block_ids in enumerate(steps):
        worker, layout = pairs[index % 2]
        worker_step().fill_groups(worker, layout, dict(enumerate(block_ids)))


def buffer_maker(device: torch.device, seed: int) -> Callable[[int], torch.Tensor]:
    def buffer_of(size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        host = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=generator)
        return host.to(device)

    return buffer_of


@dataclass
class Verdict:
    ok: bool
    said: str


def check_path(
    name: str, device: torch.device, random: bool, num_blocks: int, count: int
) -> Verdict:
    """One path's steps on `device`, against the CPU's replay and the model."""
    spec = PATHS[name]
    rig = spec.build(buffer_maker(device, 1), num_blocks)
    steps = step_block_ids(rig, count, 2)
    pairs = workers_for(rig, random)
    original = rig.buffer.cpu().view(torch.uint8).clone()
    failures = on_device(rig, pairs, steps, device)
    if spec.pages_at_once:
        fills = [f for _, layout in pairs for f in layout.pages_fills.by_group.values()]
        if None in fills or not fills:
            failures.append("not written as pages")
    result = rig.buffer.cpu().view(torch.uint8)
    replay = spec.build(buffer_maker(torch.device("cpu"), 1), num_blocks)
    noise = [layout.noise.to(torch.device("cpu")) for _, layout in pairs]
    replay_pairs = workers_for(replay, random, noise)
    run_steps(replay_pairs, steps)
    if not torch.equal(result, replay.buffer.view(torch.uint8)):
        failures.append("device != CPU replay")
    values = list(RANDOMS) if random else [(c, 0.0) for c in CONSTANTS]
    expected = expected_after(rig, original, steps, values, random)
    kept = ~expected.written
    if not torch.equal(result[kept], expected.bytes[kept]):
        failures.append("bytes outside the requested rows moved")
    sampled = expected.random_bytes
    if not torch.equal(result[~sampled], expected.bytes[~sampled]):
        failures.append("a constant's bytes wrong")
    if sampled.any():
        changed = result[sampled] != expected.bytes[sampled]
        if changed.float().mean() < 0.5:
            failures.append("random values not written")
        if not random_values_in_range(rig, result, expected):
            failures.append("random values out of range")
    said = "ok" if not failures else "WRONG (" + "; ".join(failures) + ")"
    return Verdict(not failures, said)


def on_device(rig: Rig, pairs: list, steps: list, device: torch.device) -> list[str]:
    """The steps on the device: on CUDA on a stream of their own, none
    synchronising with the host (sync debug mode "error")."""
    if device.type != "cuda":
        run_steps(pairs, steps)
        return []
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    failures = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            run_steps(pairs, steps)
    except RuntimeError as exc:  # the sync debug mode's error, or the fill's
        failures.append(f"raised {exc!r}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream.synchronize()
    return failures


def check_paths(device: torch.device, quick: bool) -> tuple[bool, list[str]]:
    """Every path, constant and random: one line each, and the table's rows."""
    num_blocks, count = (24, 8) if quick else (96, 40)
    ok, rows = True, []
    for name in PATHS:
        constant = check_path(name, device, False, num_blocks, count)
        random = check_path(name, device, True, num_blocks, count)
        ok &= constant.ok and random.ok
        said = f"constant {constant.said}  random {random.said}"
        print(f"bytes  {name:<44} {said}", flush=True)
        rows.append(f"| {name} | {constant.said} | {random.said} |")
    return ok, rows


# CUDA only: the host never waits, allocations, graphs.


def host_blocking(device: torch.device) -> Verdict:
    """A step queued behind a device sleep of `SLEEP_SECONDS` returns long
    before the sleep ends (under a tenth of it): the host never waits for
    the device, not even at a path's first fill (the cold process runs this
    first, `--host-blocking-only`)."""
    rig = PATHS["list states + attention, shared pool"].build(
        buffer_maker(device, 1), 64
    )
    pairs = workers_for(rig, False) + workers_for(rig, True)
    steps = step_block_ids(rig, len(pairs), 3)
    cycles = sleep_cycles(device)
    stream = torch.cuda.Stream(device)
    worst = 0.0
    with torch.cuda.stream(stream):
        for (worker, layout), block_ids in zip(pairs, steps, strict=True):
            torch.cuda._sleep(cycles)
            start = time.perf_counter()
            worker_step().fill_groups(worker, layout, dict(enumerate(block_ids)))
            worst = max(worst, time.perf_counter() - start)
    stream.synchronize()
    ok = worst < SLEEP_SECONDS / 10
    verdict = "ok" if ok else "BLOCKED"
    said = (
        f"{verdict} (slowest step's host time {worst * 1e3:.1f} ms behind a "
        f"{SLEEP_SECONDS * 1e3:.0f} ms device sleep)"
    )
    return Verdict(ok, said)


def sleep_cycles(device: torch.device) -> int:
    """The ``torch.cuda._sleep`` cycles of about `SLEEP_SECONDS`."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * SLEEP_SECONDS * 1e3 / max(start.elapsed_time(end), 1e-3))


def cold_host_blocking() -> Verdict:
    """`host_blocking` in a fresh interpreter, its first fill the check's."""
    result = subprocess.run(
        [sys.executable, __file__, "--host-blocking-only"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    lines = result.stdout.strip().splitlines() or [result.stderr.strip()[-300:]]
    return Verdict(result.returncode == 0, lines[-1])


def allocations(device: torch.device) -> Verdict:
    """Per warm step (each path's fills worked out already): device segments
    (cudaMalloc) and pinned host allocations (cudaHostAlloc) must be none;
    the caching allocator's calls are counted."""
    rigs = [PATHS[name].build(buffer_maker(device, 1), 64) for name in PATHS]
    runs = []
    for rig in rigs:
        for random in (False, True):
            pairs = workers_for(rig, random)
            steps = step_block_ids(rig, 8, 4)
            run_steps(pairs, steps)  # warm
            runs.append((pairs, steps))
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_stats(device)
    host_before = _host_allocs()
    for pairs, steps in runs:
        run_steps(pairs, steps)
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_stats(device)
    count = sum(len(steps) for _, steps in runs)

    def delta(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    segments, host = delta("segment.all.allocated"), _host_allocs() - host_before
    calls = delta("allocation.all.allocated") / count
    ok = segments == 0 and host <= 0
    said = (
        f"{'ok' if ok else 'ALLOCATES'} ({count} warm steps: {segments} "
        f"cudaMalloc, {host} cudaHostAlloc, {calls:.1f} caching-allocator "
        "calls a step)"
    )
    return Verdict(ok, said)


def _host_allocs() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return 0 if stats is None else int(stats().get("num_host_alloc", 0))


def graphs(device: torch.device) -> Verdict:
    """A graph that reads a block, replayed after a fill, sees the fill; a
    fill asked for while a graph is captured is not issued (nor replayed)."""
    rig = PATHS["per layer, bf16"].build(buffer_maker(device, 1), 16)
    (worker, layout), _ = workers_for(rig, False)
    cache = rig.caches[0].tensors[0]
    read = torch.empty_like(cache[5])
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        read.copy_(cache[5])
    worker_step().fill_groups(worker, layout, {0: [5]})
    graph.replay()
    torch.cuda.synchronize(device)
    sees = bool((read == CONSTANTS[0]).all()) and torch.equal(read, cache[5])
    before = rig.buffer.clone()
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        read.copy_(cache[7])  # a graph of something (an empty one warns)
        worker_step().fill_groups(worker, layout, {0: [7, 9]})
    captured.replay()
    torch.cuda.synchronize(device)
    guarded = torch.equal(before, rig.buffer)
    ok = sees and guarded
    said = (
        f"{'ok' if ok else 'WRONG'} (replay after a fill sees it: {sees}; "
        f"nothing filled from a capture: {guarded})"
    )
    return Verdict(ok, said)


def link_arrivals(device: torch.device) -> Verdict:
    """The link model's arrivals (``link``): filled from ``get_finished`` on
    the worker's own stream after the work queued before them, and reported
    only once that fill is done, and once. Behind a device sleep on the
    current stream nothing is reported and the host does not wait; after
    it, the step's ids are, and then never again."""
    link = importlib.import_module("vllm_kvfill_patch.link")
    rig = PATHS["list states + attention, shared pool"].build(
        buffer_maker(device, 2), 64
    )
    worker, layout = workers_for(rig, False)[0]
    setattr(worker, worker_step().LAYOUT_ATTR, layout)
    fill = (tuple(step_block_ids(rig, 1, 5)[0]), 16)
    arrived = {"r0": link.Transfer(fill, 0.0), "r1": link.Transfer(fill, 0.0)}
    metadata = SimpleNamespace(**{link.TRANSFERS_ATTR: arrived})
    connector = SimpleNamespace(connector_worker=worker, _connector_metadata=metadata)

    def reported() -> set:
        _, recving = link.report_arrivals(
            worker_step().fill_arrived,
            lambda _ids: (None, None),
            connector,
            (set(),),
            {},
        )
        return set(recving or ())

    torch.cuda._sleep(sleep_cycles(device))
    start = time.perf_counter()
    early = reported()
    host = time.perf_counter() - start
    torch.cuda.synchronize(device)
    done, again = reported(), reported()
    ok = not early and done == {"r0", "r1"} and not again and host < SLEEP_SECONDS / 10
    said = (
        f"{'ok' if ok else 'WRONG'} (behind a {SLEEP_SECONDS * 1e3:.0f} ms device "
        f"sleep: reported {sorted(early)} in {host * 1e3:.1f} ms of host time; after "
        f"it {sorted(done)}, then {sorted(again)})"
    )
    return Verdict(ok, said)


def cuda_checks(device: torch.device) -> tuple[bool, list[str]]:
    checks: dict[str, Callable[[], Verdict]] = {
        "host not blocked, cold process": cold_host_blocking,
        "host not blocked, warm process": lambda: host_blocking(device),
        "allocator calls per step": lambda: allocations(device),
        "CUDA graphs": lambda: graphs(device),
        "link: reported after its fill, once": lambda: link_arrivals(device),
    }
    ok, rows = True, []
    for name, check in checks.items():
        try:
            verdict = check()
        except Exception as exc:  # noqa: BLE001 - one run: report it, go on
            verdict = Verdict(False, f"FAILED: {exc!r}")
        ok &= verdict.ok
        print(f"cuda   {name:<44} {verdict.said}", flush=True)
        rows.append(f"| {name} | {verdict.said} |")
    return ok, rows


# The timed step: a 48-layer hybrid over vLLM 0.33's allocator's caches.


def step_runs(step: step_rig.Step) -> dict[str, Callable[[], None]]:
    """The patched worker's step over `step`'s caches, with the constant and
    with the random value: two workers over the same caches."""
    group_to_layers = step.group_to_layers
    runs: dict[str, Callable[[], None]] = {}
    values = {"constant": (CONSTANTS[0], 0.0), "random": RANDOMS[0]}
    for name, (mean, std) in values.items():
        worker = SimpleNamespace(kv_caches=step.kv_caches, fill_mean=mean, fill_std=std)
        # No block sizes: the split is found from the block count alone.
        layout = worker_step().CacheLayout(
            step.num_blocks, None, group_to_layers, kv_caches=step.kv_caches
        )
        runs[name] = functools.partial(
            worker_step().fill_step, worker, layout, step.requests
        )
    return runs


def far_pages_written(step: step_rig.Step, run: Callable[[], None]) -> bool:
    """One step over an unwritten buffer: each group's lowest and highest
    block in the first and the last layer written (from 256 requests,
    gigabytes past the buffer's start), the null block's page not."""
    step.buffer.fill_(step_rig.UNWRITTEN)
    run()
    pages = step.layer_pages()
    right = True
    for group, block_ids in step.block_ids.items():
        for layer in (0, step_rig.LAYERS_PER_GROUP - 1):
            for block in (min(block_ids), max(block_ids)):
                page = pages[layer, block].cpu()
                # int8 pages get zeros; the attention pages bf16 values.
                if group == 0:
                    right &= bool((page != step_rig.UNWRITTEN).any())
                else:
                    right &= bool((page == 0).all())
            right &= bool((pages[layer, 0] == step_rig.UNWRITTEN).all())
    return right


def kernels_in(run: Callable[[], None], device: torch.device) -> int | None:
    """How many kernels (and copies) one `run` launches; None where the
    profiler sees none (CUPTI missing)."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    cuda = torch.autograd.DeviceType.CUDA
    names = [e.name for e in prof.events() if e.device_type == cuda]
    return len(names) or None


TIMING_HEADER = (
    "| requests | written GiB | memset ms | constant ms | constant/memset "
    "| random ms | random/memset | host ms (constant, random) | kernels "
    "(constant, random) | far pages |"
)


def time_row(
    device: torch.device, page_bytes: int, count: int, timing: Timing
) -> tuple[str, bool]:
    """The step's row: the memset and both steps timed in turn until the
    device is done, then the steps until they return (the host's time)."""
    step = step_rig.hybrid_step(device, count, page_bytes)
    runs = step_runs(step)
    done = measure_in_turn({"memset": step.memset, **runs}, device, timing)
    memset, constant, random = (seconds(m) for m in done.values())
    host = measure_in_turn(runs, device, timing, wait=False)
    kernels = {
        name: kernels_in(run, device) if device.type == "cuda" else None
        for name, run in runs.items()
    }
    far = all(far_pages_written(step, run) for run in runs.values())
    row = (
        f"| {count} | {step.written_bytes / 2**30:.3f} | {memset * 1e3:.3f} "
        f"| {constant * 1e3:.3f} | {against(constant, memset)} "
        f"| {random * 1e3:.3f} | {against(random, memset)} "
        f"| {seconds(host['constant']) * 1e3:.3f}, "
        f"{seconds(host['random']) * 1e3:.3f} "
        f"| {kernels['constant'] or '-'}, {kernels['random'] or '-'} "
        f"| {'ok' if far else 'WRONG'} |"
    )
    return row, far


def time_steps(
    device: torch.device, page_bytes: int, requests: tuple, timing: Timing
) -> tuple[bool, list[str]]:
    print(f"\n(pages {page_bytes // 1024} KiB, {device})\n{TIMING_HEADER}")
    print("|---" * 10 + "|")
    ok, rows = True, []
    for count in requests:
        row, row_ok = time_row(device, page_bytes, count, timing)
        print(row, flush=True)
        rows.append(row)
        ok &= row_ok
    return ok, rows


def write_table(
    path: str, device_name: str, paths: list, cuda: list, timing: list, page_bytes: int
) -> None:
    lines = [
        f"`tools/gpu_check.py` on {device_name}, torch {torch.__version__}",
        "",
        "| path | constant fill | random fill |",
        "|---|---|---|",
        *paths,
        "",
    ]
    if cuda:
        lines += ["| check | result |", "|---|---|", *cuda, ""]
    lines += [f"Pages {page_bytes // 1024} KiB.", "", TIMING_HEADER]
    lines += ["|---" * 10 + "|", *timing]
    Path(path).write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (CI)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small paths, 4 KiB pages, 1 and 16 requests (CI, on the CPU)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=10,
        help=f"timed runs per step, at least (and {MIN_MEASURED_SECONDS} s at least)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        nargs="+",
        help=f"the timed step sizes (default {REQUESTS}; --quick: {QUICK_REQUESTS})",
    )
    parser.add_argument("--table", metavar="FILE", help="write the tables as Markdown")
    parser.add_argument(
        "--host-blocking-only", action="store_true", help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.host_blocking_only:
        verdict = host_blocking(torch.device("cuda"))
        print(verdict.said)
        return 0 if verdict.ok else 1
    started = time.perf_counter()
    device = torch.device(args.device)
    requests = tuple(args.requests or (QUICK_REQUESTS if args.quick else REQUESTS))
    page_bytes = QUICK_PAGE_BYTES if args.quick else PAGE_BYTES
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {name}")
    ok, path_rows = check_paths(device, args.quick)
    cuda_rows: list[str] = []
    if device.type == "cuda":
        cuda_ok, cuda_rows = cuda_checks(device)
        ok &= cuda_ok
    else:
        print(
            "cuda   not a CUDA device: streams, sync, host blocking, allocator "
            "and graphs not checked"
        )
    timing = Timing(args.repeats)
    timing_ok, timing_rows = time_steps(device, page_bytes, requests, timing)
    ok &= timing_ok
    if args.table:
        write_table(args.table, name, path_rows, cuda_rows, timing_rows, page_bytes)
    seconds = time.perf_counter() - started
    print(f"\nresult: {'ok' if ok else 'FAILED'} in {seconds:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
