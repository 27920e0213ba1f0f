"""Benchmark: the patched fill against upstream's and against the physical limit.

    python -m tools.bench [--device cuda] [--repeats N] [--table T]
        [--requests N ...] [--min-seconds S]

Three tables. "calls": one `_fill_blocks` call per case, upstream's and the
overlay's. "step": one scheduler step admitting 1 - 1024 requests of a
48-layer hybrid model, through `start_fill_kv`: upstream's step, the
overlay request by request, the overlay's one fill per group per step, and
the limit (in-place fills of the same rows, an index prebuilt per tensor).

Upstream's implementation is the installed vLLM's own ``_fill_blocks`` (the
original function, unwrapped), called on a worker holding one layer. Run it
on vLLM 0.24 - 0.29 to see both upstream paths: the attention fill (a
temporary the size of the filled region, then a scatter) and #45080's
whole-tensor state fill; on 0.11.1 - 0.23 the state case crashes upstream.
The limit is a memset (an in-place constant fill) of a contiguous buffer of
the same bytes, for random fills too: they copy samples drawn once per
registration (``fill.NoiseBank``), and no fill of the bytes writes them
faster. Times are medians, the calls a row compares timed in
turn, round after round (``tools/timing.py``, the GPU check's harness too);
memory is the peak allocated during one call, beyond what was allocated
before it. The step tables time the step of ``tools/step_rig.py``: the
"allocated" table over caches vLLM's own allocator builds, the "step" table
over one pool per layer slot with list states.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import vllm_kvfill_patch
from tools import step_rig
from tools.step_rig import (
    BLOCK_TOKENS,
    KERNEL_SPLIT,
    LAYERS_PER_GROUP,
    LINEAR_GROUPS,
    STATE_BLOCKS,
    layer_names,
    step_blocks,
    step_requests,
)
from tools.timing import (
    MIN_MEASURED_SECONDS,
    Measured,
    Timing,
    against,
    measure,
    measure_in_turn,
    peak_allocated,
    seconds,
)
from vllm_kvfill_patch.gating import CONNECTOR_MODULE, bare_worker, upstream_function

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
        return state_views(pool, num_blocks, STATE_SHAPES, page_elements)

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


def state_views(
    pool: torch.Tensor, num_blocks: int, shapes: tuple, page_elements: int
) -> list[torch.Tensor]:
    """Mamba states as vLLM views them: ``(num_blocks, *shape)`` each, over
    one page per block of `pool`, one after another within the page."""
    states, offset = [], 0
    for shape in shapes:
        strides = [torch.Size(shape[i + 1 :]).numel() for i in range(len(shape))]
        states.append(
            torch.as_strided(
                pool, (num_blocks, *shape), (page_elements, *strides), offset
            )
        )
        offset += torch.Size(shape).numel()
    return states


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


def upstream_method(name: str) -> tuple[type, Callable]:
    """The installed vLLM's worker class and its original method `name`.

    Upstream's own function, under any other package's wrapper (ours wraps
    only the connector's ``start_load_kv``).
    """
    import importlib

    module = importlib.import_module(CONNECTOR_MODULE)
    worker_cls = module.DecodeBenchConnectorWorker
    return worker_cls, upstream_function(worker_cls, name)


def one_layer_worker(
    worker_cls: type, cache: torch.Tensor, case: Case, mean: float
) -> tuple[Any, Any]:
    from vllm_kvfill_patch.worker_step import layout_from

    worker = bare_worker(
        worker_cls, {"layer": cache}, {0: ["layer"]}, case.num_blocks, mean, case.std
    )
    return worker, layout_from(worker.vllm_config.cache_config, None, worker)


def run_case(case: Case, device: torch.device, timing: Timing, mean: float) -> dict:
    worker_cls, upstream = upstream_method("_fill_blocks")
    from vllm_kvfill_patch.worker_step import fill_groups

    limit_buffer = torch.empty(case.filled_bytes, dtype=torch.uint8, device=device)
    limit_view = limit_buffer.view(case.dtype)

    def limit():
        limit_view.fill_(mean)

    cache = case.make_cache(device)
    worker, layout = one_layer_worker(worker_cls, cache, case, mean)
    tokens = 16 * len(case.block_ids)
    calls = {
        "limit": limit,
        "upstream": lambda: upstream(worker, 0, case.block_ids, tokens),
        "overlay": lambda: fill_groups(worker, layout, {0: case.block_ids}),
    }
    result = measure_in_turn(calls, device, timing)
    for name, measured in result.items():
        if measured.seconds is not None:
            measured.peak_bytes = peak_allocated(calls[name], device)
    del cache, limit_buffer, calls
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


# The step table: one admission step of a Qwen3-Next-like hybrid model.

STEP_PAGE_BYTES = 4096
STEP_ATTENTION_BLOCK = (2, 16, 1, 64)  # K/V, tokens, heads, head_dim; bf16
STEP_STATES = ((3, 128), (2, 16, 16))  # conv, recurrent; fp32
"""The step (``tools/step_rig``) at Qwen3-Next-80B-at-TP=4's pages (536 KiB:
conv (3, 2048), recurrent (8, 128, 128) in fp32) scaled down 128x in
channels and heads, to 4 KiB pages, so that a pool for 1024 requests is 12 x
11,265 pages = 540 MiB."""
STEP_REQUESTS = (1, 16, 256, 1024)
RANDOM_STD = 0.1
"""The random step's ``fill_std`` (`--std`)."""
UPSTREAM_MAX_REQUESTS = 256
"""Upstream 0.24 fills every state tensor whole per request: its step grows
with requests x pool, and at 1024 requests would take minutes."""


def step_worker(
    worker_cls: type, requests: int, device: torch.device, mean: float
) -> tuple[Any, Any, dict]:
    """A worker holding the step's 48 layers over shared pools, and the step's
    metadata ``{req_id: (block_ids_per_group, num_tokens)}``."""
    from vllm_kvfill_patch.worker_step import layout_from

    num_blocks = step_blocks(requests)
    page_floats = STEP_PAGE_BYTES // 4
    caches: dict[str, Any] = {}
    groups: dict[int, list[str]] = {g: [] for g in range(1 + LINEAR_GROUPS)}
    for slot in range(LAYERS_PER_GROUP):
        pool = torch.zeros(num_blocks * page_floats, device=device)
        attention = f"layers.{slot}.attn"
        caches[attention] = pool.view(torch.bfloat16).view(
            num_blocks, *STEP_ATTENTION_BLOCK
        )
        groups[0].append(attention)
        for group in range(1, 1 + LINEAR_GROUPS):
            linear = f"layers.{slot}.linear{group}"
            caches[linear] = state_views(pool, num_blocks, STEP_STATES, page_floats)
            groups[group].append(linear)
    worker = bare_worker(worker_cls, caches, groups, num_blocks, mean)
    layout = layout_from(worker.vllm_config.cache_config, None, worker)
    reqs = step_requests(requests, num_blocks)
    return worker, layout, reqs


def step_limit(worker: Any, reqs: dict, mean: float) -> Callable[[], None]:
    """In-place fills of the same rows, the index prebuilt per tensor."""
    by_group: dict[int, list[int]] = {}
    for block_ids_per_group, _ in reqs.values():
        for g, ids in enumerate(block_ids_per_group):
            by_group.setdefault(g, []).extend(ids)
    fills = []
    for g, ids in by_group.items():
        for name in worker.group_to_layers[g]:
            cache = worker.kv_caches[name]
            for tensor in cache if isinstance(cache, list) else [cache]:
                index = torch.tensor(sorted(set(ids)), device=tensor.device)
                fills.append((tensor, index))

    def limit():
        for tensor, index in fills:
            tensor.index_fill_(0, index, mean)

    return limit


def step_table(
    device: torch.device,
    timing: Timing,
    mean: float,
    series: ModuleType | None,
    request_counts: Sequence[int] = STEP_REQUESTS,
) -> None:
    series_columns = " | series per step ms | series/limit" if series else ""
    print(
        "\n| requests | layer fills | filled MiB | limit ms | upstream step ms "
        "| overlay per request ms | overlay per step ms | step/limit "
        f"| upstream/step | per-request overhead us{series_columns} |"
    )
    print("|---" * (10 + (2 if series else 0)) + "|")
    for requests in request_counts:
        print(step_row(requests, device, timing, mean, series), flush=True)
    print(
        f"(upstream not run above {UPSTREAM_MAX_REQUESTS} requests: its step grows "
        "with requests x pool size)"
    )


def step_row(
    requests: int,
    device: torch.device,
    timing: Timing,
    mean: float,
    series: ModuleType | None,
) -> str:
    from vllm_kvfill_patch.worker_step import fill_groups, fill_step

    module = importlib.import_module(CONNECTOR_MODULE)
    worker_cls, upstream_fill_kv = upstream_method("start_fill_kv")
    worker, layout, reqs = step_worker(worker_cls, requests, device, mean)
    metadata = module.DecodeBenchConnectorMetadata(reqs_to_fill=reqs)
    blocks_per_slot = step_rig.ATTENTION_BLOCKS + LINEAR_GROUPS * STATE_BLOCKS
    filled_bytes = requests * LAYERS_PER_GROUP * blocks_per_slot * STEP_PAGE_BYTES

    def per_request():
        for block_ids_per_group, _tokens in reqs.values():
            fill_groups(worker, layout, dict(enumerate(block_ids_per_group)))

    calls = {
        "limit": step_limit(worker, reqs, mean),
        "step": lambda: fill_step(worker, layout, reqs),
    }
    if series is not None:
        calls["series"] = series_step(series, worker, reqs, mean)
    in_turn = measure_in_turn(calls, device, timing)
    limit, step = in_turn["limit"], in_turn["step"]
    fewer = timing.with_repeats(max(1, timing.repeats // 4))
    by_request = measure(per_request, device, fewer, peak=False)
    upstream = upstream_step(
        lambda: upstream_fill_kv(worker, metadata), requests, device, timing
    )
    limit_s, step_s, by_request_s = (seconds(m) for m in (limit, step, by_request))
    vs_upstream = "-" if upstream.seconds is None else upstream.seconds / step_s
    cells = [
        str(requests),
        f"{requests * len(worker.kv_caches):,}",
        f"{filled_bytes / MIB:.1f}",
        f"{limit_s * 1e3:.2f}",
        _ms(upstream),
        f"{by_request_s * 1e3:.2f}",
        f"{step_s * 1e3:.2f}",
        against(step_s, limit_s),
        vs_upstream if vs_upstream == "-" else f"{vs_upstream:.0f}x",
        f"{(step_s - limit_s) / requests * 1e6:.1f}",
    ]
    if series is not None:
        patched = in_turn["series"]
        cells += [
            f"{seconds(patched) * 1e3:.2f}",
            against(seconds(patched), limit_s),
        ]
    return "| " + " | ".join(cells) + " |"


def series_step(
    series: ModuleType, worker: Any, reqs: dict, mean: float
) -> Callable[[], None]:
    """The patched file's own step, on a worker of its class over the same
    caches."""
    series_worker = bare_worker(
        series.DecodeBenchConnectorWorker,
        worker.kv_caches,
        worker.group_to_layers,
        worker.num_blocks,
        mean,
    )
    metadata = series.DecodeBenchConnectorMetadata(reqs_to_fill=reqs)
    return lambda: series_worker.start_fill_kv(metadata)


def allocated_table(
    device: torch.device,
    timing: Timing,
    mean: float,
    request_counts: Sequence[int] = STEP_REQUESTS,
    std: float = RANDOM_STD,
) -> None:
    """The step on caches vLLM's own allocator builds (0.32+): one backing
    buffer, layer-outer (LBNHC), the attention group kernel-split, Mamba
    layers as int8 pages (zeros: they cannot hold a float). The constant
    step and the random one (``fill_std`` = `std`), each against upstream's
    step and a memset of exactly the bytes the step must write: the limit
    of any fill of them."""
    print(
        "\n| requests | written MiB | memset ms | constant ms | constant/memset "
        "| upstream ms | upstream/constant | random ms | random/memset "
        "| upstream random ms | upstream/random |"
    )
    print("|---" * 11 + "|")
    for requests in request_counts:
        print(allocated_row(requests, device, timing, mean, std), flush=True)
    print(
        f"(random: fill_std {std}; upstream not run above "
        f"{UPSTREAM_MAX_REQUESTS} requests)"
    )


def allocated_caches(num_blocks: int, device: torch.device) -> tuple[Any, dict]:
    """A 48-layer hybrid's KV-cache config (vLLM's own classes) and the caches
    ``allocate_kv_cache`` builds for it: 12 attention layers in one group,
    36 Mamba layers in three, every group over the same backing buffer."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    attention = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=BLOCK_TOKENS,
        shapes=STEP_STATES,
        dtypes=(torch.float32, torch.float32),
        page_size_padded=STEP_PAGE_BYTES,
    )
    assert attention.page_size_bytes == STEP_PAGE_BYTES
    size = LAYERS_PER_GROUP * num_blocks * STEP_PAGE_BYTES
    groups, tensors = [], []
    for group in range(1 + LINEAR_GROUPS):
        layers = layer_names(group)
        groups.append(KVCacheGroupSpec(layers, attention if group == 0 else mamba))
        tensors.append(
            KVCacheTensor(
                size=size,
                layers=layers,
                layer_stride=num_blocks * STEP_PAGE_BYTES,
                block_stride=STEP_PAGE_BYTES,
            )
        )
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )
    kernel_sizes = [BLOCK_TOKENS // KERNEL_SPLIT] + [BLOCK_TOKENS] * LINEAR_GROUPS
    caches = allocate_kv_cache(config, device, KVCacheLayout.LBNHC, kernel_sizes)
    return config, caches


def allocated_row(
    requests: int, device: torch.device, timing: Timing, mean: float, std: float
) -> str:
    from vllm_kvfill_patch.worker_step import fill_step, layout_from

    module = importlib.import_module(CONNECTOR_MODULE)
    worker_cls, upstream_fill_kv = upstream_method("start_fill_kv")
    config, caches = allocated_caches(step_blocks(requests), device)
    group_to_layers = {
        g: group.layer_names for g, group in enumerate(config.kv_cache_groups)
    }
    step = step_rig.Step(caches, group_to_layers, requests)
    metadata = module.DecodeBenchConnectorMetadata(reqs_to_fill=step.requests)
    workers = {
        name: bare_worker(worker_cls, caches, group_to_layers, step.num_blocks, mean, s)
        for name, s in (("constant", 0.0), ("random", std))
    }
    calls: dict[str, Callable[[], object]] = {"memset": step.memset}
    for name, worker in workers.items():
        layout = layout_from(None, config, worker)
        calls[name] = functools.partial(fill_step, worker, layout, step.requests)
    in_turn = measure_in_turn(calls, device, timing)
    memset_s, constant_s, random_s = (seconds(m) for m in in_turn.values())
    upstream = {
        name: upstream_step(
            functools.partial(upstream_fill_kv, worker, metadata),
            requests,
            device,
            timing,
        )
        for name, worker in workers.items()
    }

    def upstream_against(name: str, step_s: float) -> str:
        measured = upstream[name].seconds
        return "-" if measured is None else f"{measured / step_s:.1f}x"

    cells = [
        str(requests),
        f"{step.written_bytes / MIB:.1f}",
        f"{memset_s * 1e3:.3f}",
        f"{constant_s * 1e3:.3f}",
        against(constant_s, memset_s),
        _ms(upstream["constant"]),
        upstream_against("constant", constant_s),
        f"{random_s * 1e3:.3f}",
        against(random_s, memset_s),
        _ms(upstream["random"]),
        upstream_against("random", random_s),
    ]
    return "| " + " | ".join(cells) + " |"


def upstream_step(
    call: Callable[[], None], requests: int, device: torch.device, timing: Timing
) -> Measured:
    """Upstream's step: not run above UPSTREAM_MAX_REQUESTS, run once above
    16 requests (one run takes seconds there)."""
    if requests > UPSTREAM_MAX_REQUESTS:
        return Measured(None, None, "not run")
    once = timing.with_repeats(1) if requests > 16 else timing
    return measure(call, device, once, peak=False)


def load_module_file(name: str, path: str | None) -> ModuleType | None:
    """The module in `path` (a connector file), or None without one."""
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _ms(m: Measured) -> str:
    if m.seconds is None:
        return m.error if m.error == "not run" else "crash"
    return f"{m.seconds * 1e3:.2f}"


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=MIN_MEASURED_SECONDS,
        help="time each call for at least this long (default %(default)s)",
    )
    parser.add_argument("--mean", type=float, default=0.015)
    parser.add_argument(
        "--std",
        type=float,
        default=RANDOM_STD,
        help="the allocated table's random step's fill_std (default %(default)s)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        nargs="+",
        default=STEP_REQUESTS,
        help="the step tables' request counts (default: 1 16 256 1024)",
    )
    parser.add_argument(
        "--table",
        choices=("calls", "step", "allocated", "all"),
        default="all",
        help="which table (allocated: caches built by vLLM 0.32+'s allocator)",
    )
    parser.add_argument(
        "--series",
        metavar="FILE",
        help="the connector file with patches/' series applied: its step too",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = arguments().parse_args(argv)
    device = torch.device(args.device)
    timing = Timing(args.repeats, args.min_seconds)

    vllm_kvfill_patch.apply()
    _, upstream = upstream_method("_fill_blocks")
    status = vllm_kvfill_patch.status()
    print(
        f"vLLM {status.vllm_version}; patch {status.decision.value}; "
        f"upstream = {upstream.__module__}.{upstream.__qualname__}; device {device}; "
        f"torch {torch.__version__}; {torch.get_num_threads()} threads; "
        f"median of at least {args.repeats} runs and {args.min_seconds} s, "
        "the calls of a row timed in turn"
    )
    if args.table in ("calls", "all"):
        print(
            "| case | filled MiB | limit ms | upstream ms | overlay ms | overlay/limit "
            "| overlay/upstream | upstream peak MiB | overlay peak MiB |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for case in cases():
            print(
                format_row(case, run_case(case, device, timing, args.mean)),
                flush=True,
            )
    if args.table in ("step", "all"):
        series = load_module_file("kvfill_series_connector", args.series)
        step_table(device, timing, args.mean, series, args.requests)
    if args.table == "allocated" or (args.table == "all" and _has_allocator()):
        allocated_table(device, timing, args.mean, args.requests, args.std)


def _has_allocator() -> bool:
    return importlib.util.find_spec("vllm.v1.kv_cache_layout") is not None


if __name__ == "__main__":
    main()
