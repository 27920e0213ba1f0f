"""The current releases (0.30+): the overlay keeps what upstream's connector
does right and fixes what it gets wrong.

Differential, on the installed release's real connector: the same caches
(random bytes, so an untouched byte is recognisable) filled by upstream's own
methods (the overlay reverted), by the overlay, and, where ``patches/`` has a
file for this release, by the patched file loaded beside the original. Where
upstream handles a layout, every implementation must write upstream's bytes,
and those bytes must be the value expected; where it does not, the tests show
upstream's wrong rows and the right ones. Run in the sessions of releases
from 0.30.0 (noxfile.py).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import sys

import pytest
import torch

import vllm_kvfill_patch
from tests.helpers import overlay_reverted, patches_by_release
from tests.hybrid import (
    ATTENTION_LAYER,
    BLOCK_SIZE,
    HEAD_DIM,
    HEADS,
    PAGE_BYTES,
    kv_cache_tensor,
    make_pool,
    make_worker_connector,
    start_fill,
)
from vllm_kvfill_patch import Decision
from vllm_kvfill_patch.gating import CONNECTOR_MODULE
from vllm_kvfill_patch.releases import parse_release

NUM_BLOCKS = 10
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
REQUESTS = {"a": (([2, 3], [4]), 32), "b": (([6], [7, 8]), 32)}
"""Two requests, two groups: group 0 gets blocks 2, 3, 6; group 1 4, 7, 8."""
FILLED = {LAYERS[0]: [2, 3, 6], LAYERS[1]: [4, 7, 8]}


@pytest.fixture(scope="module")
def release(vllm_version) -> tuple[int, int, int]:
    return parse_release(vllm_version)


@pytest.fixture(scope="module")
def implementations(request, vllm_version, vllm_config_for) -> dict:
    """{name: connector module}; "upstream" runs with the overlay reverted."""
    vllm_config_for()  # loads vLLM's plugins, this package's among them
    module = importlib.import_module(CONNECTOR_MODULE)
    assert vllm_kvfill_patch.status().decision is Decision.APPLIED
    found = {"upstream": module, "overlay": module}
    if vllm_version in patches_by_release():
        path = request.getfixturevalue("patched_connector")
        spec = importlib.util.spec_from_file_location("kvfill_patched_connector", path)
        patched = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = patched
        spec.loader.exec_module(patched)
        found["patched"] = patched
    return found


def attention_config(dtype, spec_classes=None, **fields):
    """Two attention layers in two groups (full attention unless given)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec_classes = spec_classes or (FullAttentionSpec, FullAttentionSpec)
    page = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * dtype.itemsize
    groups = [
        KVCacheGroupSpec(
            [layer],
            spec_class(
                block_size=BLOCK_SIZE,
                num_kv_heads=HEADS,
                head_size=HEAD_DIM,
                dtype=dtype,
                **fields,
            ),
        )
        for layer, spec_class in zip(LAYERS, spec_classes, strict=True)
    ]
    tensors = [
        kv_cache_tensor(KVCacheTensor, NUM_BLOCKS, page, layer) for layer in LAYERS
    ]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def fp8_fields() -> dict:
    """The spec fields vLLM sets for a per-tensor fp8 cache (0.31+ reads them)."""
    from vllm.v1 import kv_cache_interface

    if not hasattr(kv_cache_interface, "KVQuantMode"):
        return {}
    return {"kv_quant_mode": kv_cache_interface.KVQuantMode.FP8_PER_TENSOR}


def fill_with(name, module, vllm_config, kv_cache_config, dtype, reqs) -> dict:
    """Register fresh caches (the same random bytes every time) on a new
    worker-role connector of `module`, run one step; the caches after it."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    generator = torch.Generator().manual_seed(0)
    caches = {
        layer: torch.randint(
            0, 256, (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM * dtype.itemsize),
            dtype=torch.uint8, generator=generator,
        ).view(dtype)
        for layer in LAYERS
    }  # fmt: skip
    with running_as(name):
        connector = module.DecodeBenchConnector(
            vllm_config, KVConnectorRole.WORKER, kv_cache_config
        )
        connector.register_kv_caches(caches)
        start_fill(connector, reqs)
    return caches


def running_as(name: str):
    """Upstream's own methods for "upstream"; as installed for the others."""
    return overlay_reverted() if name == "upstream" else contextlib.nullcontext()


def fill_all(implementations, *args) -> dict:
    """{implementation: caches after the step}."""
    return {
        name: fill_with(name, module, *args) for name, module in implementations.items()
    }


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def assert_writes(results: dict, expected_rows: dict, upstream_right: bool = True):
    """Every implementation (upstream too, when `upstream_right`) wrote
    `expected_rows[layer]` (a uint8 row) into exactly FILLED[layer]'s blocks."""
    untouched = fill_with_nothing(results)
    for name, caches in results.items():
        if name == "upstream" and not upstream_right:
            continue
        for layer, rows in FILLED.items():
            got = as_bytes(caches[layer])
            for block in range(NUM_BLOCKS):
                if block in rows:
                    assert torch.equal(got[block], expected_rows[layer]), (
                        name,
                        layer,
                        block,
                    )
                else:
                    assert torch.equal(got[block], untouched[layer][block]), (
                        name,
                        layer,
                        block,
                    )


def fill_with_nothing(results: dict) -> dict:
    """The caches' starting bytes (fill_with's generator, replayed)."""
    some = next(iter(results.values()))
    generator = torch.Generator().manual_seed(0)
    return {
        layer: torch.randint(
            0, 256, as_bytes(some[layer]).shape, dtype=torch.uint8, generator=generator
        )
        for layer in LAYERS
    }


def constant_row(value: float, dtype: torch.dtype, stored_as: torch.dtype):
    """One block's bytes holding `value` in `dtype`, stored as `stored_as`."""
    shape = (2, BLOCK_SIZE, HEADS, HEAD_DIM)
    return torch.full(shape, value, dtype=dtype).view(stored_as).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_constant_fill_writes_upstreams_bytes(implementations, vllm_config_for, dtype):
    results = fill_all(
        implementations,
        vllm_config_for(fill_mean=0.5),
        attention_config(dtype),
        dtype,
        REQUESTS,
    )
    row = constant_row(0.5, dtype, dtype)
    assert_writes(results, {layer: row for layer in LAYERS})


@pytest.fixture
def fp8_cache_dtype(vllm_config_for):
    """Sets vLLM's --kv-cache-dtype on the configs the tests share, for one test."""
    configs = []

    def use(cache_dtype: str, **extra):
        config = vllm_config_for(**extra)
        configs.append((config, config.cache_config.cache_dtype))
        config.cache_config.cache_dtype = cache_dtype
        return config

    yield use
    for config, original in configs:
        config.cache_config.cache_dtype = original


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("mean", [0.5, 1e6], ids=["in-range", "out-of-range"])
def test_fp8_caches_get_the_encoded_and_clamped_value(
    implementations, fp8_cache_dtype, release, cache_dtype, mean
):
    """vLLM stores fp8 caches as uint8; the value is written in the fp8
    encoding, clamped to its finite range (448 for e4m3, 57344 for e5m2).
    0.30 writes the mean cast to uint8 (0 for 0.5, and 1e6 overflows)."""
    encoding = FP8[cache_dtype]
    config = fp8_cache_dtype(cache_dtype, fill_mean=mean)
    if release < (0, 31, 0):
        implementations = {"overlay": implementations["overlay"]}
    results = fill_all(
        implementations,
        config,
        attention_config(torch.uint8, **fp8_fields()),
        torch.uint8,
        REQUESTS,
    )
    value = min(mean, torch.finfo(encoding).max)
    row = constant_row(value, encoding, torch.uint8)
    assert_writes(results, {layer: row for layer in LAYERS})


@pytest.mark.parametrize("std", [0.0, 1.0], ids=["constant", "random"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_out_of_range_mean_is_clamped_to_the_largest_finite_value(
    implementations, vllm_config_for, release, dtype, std
):
    if release < (0, 31, 0):  # 0.30 raises on the overflow, or writes inf
        implementations = {"overlay": implementations["overlay"]}
    results = fill_all(
        implementations,
        vllm_config_for(fill_mean=-1e300, fill_std=std),
        attention_config(dtype),
        dtype,
        REQUESTS,
    )
    row = constant_row(torch.finfo(dtype).min, dtype, dtype)
    assert_writes(results, {layer: row for layer in LAYERS})


def test_circular_buffer_group_is_zero_filled(implementations, vllm_config_for):
    from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec

    dtype = torch.bfloat16
    results = fill_all(
        implementations,
        vllm_config_for(fill_mean=0.5),
        attention_config(dtype, (FullAttentionSpec, CircularBufferSpec)),
        dtype,
        REQUESTS,
    )
    assert_writes(
        results,
        {
            LAYERS[0]: constant_row(0.5, dtype, dtype),
            LAYERS[1]: constant_row(0, dtype, dtype),
        },
    )


def test_startup_fill_fills_every_block_once_at_registration(
    implementations, vllm_config_for, release
):
    dtype = torch.bfloat16
    results = fill_all(
        implementations,
        vllm_config_for(fill_mean=0.5, startup_fill=True),
        attention_config(dtype),
        dtype,
        {},
    )
    for name, caches in results.items():
        for layer, cache in caches.items():
            if release >= (0, 31, 0):
                assert (cache == 0.5).all(), (name, layer)
            else:  # 0.30 has no startup fill: nothing is written
                assert not (cache == 0.5).all(), (name, layer)
    reference = results["upstream"]
    for name, caches in results.items():
        for layer in LAYERS:
            same = torch.equal(as_bytes(caches[layer]), as_bytes(reference[layer]))
            assert same, (name, layer)


def test_packed_integer_pages_get_zeros_and_one_warning(
    implementations, vllm_config_for
):
    """From 0.27 a Mamba layer reaches the connector as raw int8 pages;
    neither upstream nor the overlay can write a float there: zeros."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vllm").addHandler(handler)
    try:
        results = fill_all(
            implementations,
            vllm_config_for(fill_mean=0.5),
            attention_config(torch.int8, (FullAttentionSpec, FullAttentionSpec)),
            torch.int8,
            REQUESTS,
        )
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    zeros = constant_row(0, torch.int8, torch.int8)
    assert_writes(results, {layer: zeros for layer in LAYERS})
    overlay = [r for r in records if "vllm-kvfill-patch" in r.getMessage()]
    assert [r.levelno for r in overlay if "zeros" in r.getMessage()] == [
        logging.WARNING
    ] * len(LAYERS), [r.getMessage() for r in overlay]


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.bfloat16, None), (torch.float32, None), (torch.uint8, "fp8_e4m3")],
    ids=["bf16", "fp32", "fp8_e4m3"],
)
def test_random_fill_matches_upstreams_distribution(
    implementations, fp8_cache_dtype, release, dtype, cache_dtype
):
    if cache_dtype and release < (0, 31, 0):  # no fp8 handling upstream
        implementations = {"overlay": implementations["overlay"]}
    fields = fp8_fields() if cache_dtype else {}
    config = fp8_cache_dtype(cache_dtype or "auto", fill_mean=0.5, fill_std=0.1)
    many = {"a": ((list(range(1, NUM_BLOCKS)), []), 32)}
    results = fill_all(
        implementations, config, attention_config(dtype, **fields), dtype, many
    )
    stats = {}
    for name, caches in results.items():
        cache = caches[LAYERS[0]][1:]
        values = cache.view(torch.float8_e4m3fn) if cache_dtype else cache
        values = values.float()
        stats[name] = (values.mean().item(), values.std().item())
        assert abs(stats[name][0] - 0.5) < 0.01, (name, stats)
        assert abs(stats[name][1] - 0.1) < 0.01, (name, stats)
        assert torch.equal(
            as_bytes(caches[LAYERS[1]]), as_bytes(results["overlay"][LAYERS[1]])
        )
    assert len({round(s[1], 2) for s in stats.values()}) <= 2, stats


@pytest.mark.parametrize("ratio", [2, 4])
def test_kernel_split_cache_upstream_writes_kernel_row_b_the_fix_block_b(
    implementations, vllm_config_for, ratio
):
    """Kernel-split attention caches (N * r kernel rows): upstream writes row
    3, a piece of block 3 // r; block 3 is rows 3r .. 3r + r - 1."""
    for name, module in implementations.items():
        pool = make_pool(NUM_BLOCKS, kernel_split=ratio)
        attention = pool.caches[ATTENTION_LAYER]
        before = attention.clone()
        with running_as(name):
            connector = make_worker_connector(
                vllm_config_for(fill_mean=0.5), pool, module=module
            )
            start_fill(connector, {"r": (([3], []), 16)})
        changed = {
            row
            for row in range(NUM_BLOCKS * ratio)
            if not torch.equal(
                attention[row].view(torch.int16), before[row].view(torch.int16)
            )
        }
        expected = {3} if name == "upstream" else set(range(3 * ratio, 4 * ratio))
        assert changed == expected, name
        assert all((attention[row] == 0.5).all() for row in expected), name


def test_list_state_cache_upstream_fills_whole_the_fix_its_rows(
    implementations, vllm_config_for
):
    """Out-of-tree platforms (vLLM-Ascend) still register Mamba states as a
    list of block-indexed views over pages shared with attention."""
    for name, module in implementations.items():
        pool = make_pool(NUM_BLOCKS)
        before = pool.raw.clone().view(NUM_BLOCKS, PAGE_BYTES)
        with running_as(name):
            connector = make_worker_connector(
                vllm_config_for(fill_mean=0.5), pool, module=module
            )
            start_fill(connector, {"r": (([], [5]), 16)})
        pages = pool.pages()
        changed = {b for b in range(NUM_BLOCKS) if not torch.equal(pages[b], before[b])}
        assert changed == (set(range(NUM_BLOCKS)) if name == "upstream" else {5}), name


def test_scheduler_side_and_loaded_group_ids_stay_upstreams(vllm_config_for):
    """The overlay wraps only the worker side's step and fill."""
    from tests.children import wrapper_count

    vllm_config_for()  # loads vLLM's plugins, this package's among them
    module = importlib.import_module(CONNECTOR_MODULE)
    assert vllm_kvfill_patch.status().decision is Decision.APPLIED
    scheduler_methods = [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "request_finished",
        "get_loaded_kv_cache_group_ids",  # 0.33
    ]
    for name in scheduler_methods:
        method = module.DecodeBenchConnector.__dict__.get(name)
        if method is not None:
            assert wrapper_count(method) == 0, name
    # Where the overlay does wrap, the same check sees it.
    load = module.DecodeBenchConnector.__dict__["start_load_kv"]
    assert wrapper_count(load) == 1
