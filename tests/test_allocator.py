"""Caches as vLLM's own allocator (0.32+) builds them, filled byte for byte.

vLLM's planner (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``)
places the layers of each case in one backing buffer for every
``KVCacheLayout`` it accepts, and its allocator (``allocate_kv_cache``) views
it per layer, kernel-split where the case asks for smaller kernel blocks. A
step of the real worker-role DecodeBenchConnector then fills some blocks of
each group; the whole backing buffer must equal the snapshot with exactly
those blocks' pages (all kernel rows of each) set to the value upstream
writes there, and nothing else changed.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from types import ModuleType

import pytest
import torch

from tests.hybrid import make_request, start_fill
from vllm_kvfill_patch.releases import parse_release

MEAN = 0.5


def attention(**fields):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16, **fields}
    return FullAttentionSpec(**spec)


def compressed_mla(block_size: int):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    # DeepSeek-V4 style: one stored state per 4 tokens.
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.bfloat16,
        tokens_per_state=4,
    )


def three_group_hybrid(mamba, prefix: str = "l") -> dict:
    """Two attention layers and four Mamba layers: vLLM plans one attention
    group and two Mamba groups, all three overlaid on the same pages (the
    two Mamba groups' identical)."""
    layers = {f"{prefix}{i}.attn": attention(block_size=64) for i in range(2)}
    return layers | {f"{prefix}{i}.mamba": mamba for i in range(2, 6)}


def cases() -> dict:
    """name: (layer specs, kernel block size per group or None, cache dtype)."""
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        KVQuantMode,
        MambaSpec,
        SlidingWindowSpec,
    )

    fp8 = {"dtype": torch.uint8, "kv_quant_mode": KVQuantMode.FP8_PER_TENSOR}
    mamba = MambaSpec(
        block_size=64,
        shapes=((3, 64), (2, 16, 16)),
        dtypes=(torch.bfloat16, torch.float32),
    )
    return {
        "dense": ({f"l{i}.attn": attention(block_size=16) for i in range(3)}, None),
        "split-2": ({f"l{i}.attn": attention(block_size=64) for i in range(2)}, 32),
        "split-4": ({f"l{i}.attn": attention(block_size=64) for i in range(2)}, 16),
        "compressed": ({f"l{i}.mla": compressed_mla(64) for i in range(2)}, None),
        "compressed-split": ({f"l{i}.mla": compressed_mla(64) for i in range(2)}, 32),
        "fp8": (
            {f"l{i}.attn": attention(block_size=16, **fp8) for i in range(2)},
            None,
        ),
        "float8": (
            {"l0.attn": attention(block_size=16, dtype=torch.float8_e4m3fn)},
            None,
        ),
        "sliding": (
            {
                "l0.attn": attention(block_size=16),
                "l1.swa": SlidingWindowSpec(
                    block_size=16,
                    num_kv_heads=2,
                    head_size=64,
                    dtype=torch.bfloat16,
                    sliding_window=32,
                ),
            },
            None,
        ),
        "hybrid": ({"l0.attn": attention(block_size=64), "l1.mamba": mamba}, None),
        "hybrid, three groups": (three_group_hybrid(mamba), None),
        # A compressor's ring: upstream (and so the overlay) writes zeros.
        "circular": (
            {
                "l0.attn": attention(block_size=16),
                "l1.ring": CircularBufferSpec(
                    block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
                ),
            },
            None,
        ),
    }


@pytest.fixture(scope="module")
def base_config(tiny_model):
    from tests.hybrid import make_vllm_config

    return make_vllm_config(tiny_model, fill_mean=MEAN)


def kv_cache_planner() -> ModuleType:
    """The module of vLLM's KV-cache planner (``get_kv_cache_groups``,
    ``get_kv_cache_config_from_groups``): its own from 0.33, in
    ``kv_cache_utils`` in 0.32."""
    name = "vllm.v1.core.kv_cache_planning"
    if importlib.util.find_spec(name) is None:
        name = "vllm.v1.core.kv_cache_utils"
    return importlib.import_module(name)


def allocated(base_config, specs: dict, kernel_block_size, layout):
    """vLLM's own plan and allocation for `specs` in `layout`, or None where
    vLLM refuses the layout for them."""
    from vllm.v1.worker.utils import allocate_kv_cache

    planner = kv_cache_planner()
    config = copy.deepcopy(base_config)
    config.cache_config.kv_cache_layout = layout.name
    config.cache_config.cache_dtype = "fp8_e4m3"  # what an fp8 spec is stored as
    try:
        groups = planner.get_kv_cache_groups(config, specs)
        kv_cache_config = planner.get_kv_cache_config_from_groups(
            config, groups, 1 << 21
        )
        kernel_sizes = None
        if kernel_block_size is not None:
            kernel_sizes = [kernel_block_size] * len(groups)
        caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), layout, kernel_sizes
        )
    except ValueError:
        return None
    return config, kv_cache_config, caches


def backing_buffer(caches: dict) -> torch.Tensor:
    storage = next(iter(caches.values())).untyped_storage()
    return torch.empty(0, dtype=torch.int8).set_(storage)


def upstream_value(worker, group_idx: int, layer: str, dtype: torch.dtype):
    """The value upstream 0.33 writes into this layer, as a 0-d tensor of the
    cache's dtype (its _make_fill_values, per layer)."""
    if group_idx in worker._zero_fill_group_ids:
        return torch.zeros((), dtype=dtype)
    encoding = worker._fp8_dtypes.get(layer, dtype)
    if not encoding.is_floating_point:
        return torch.zeros((), dtype=dtype)
    finfo = torch.finfo(encoding)
    value = torch.tensor(min(max(MEAN, finfo.min), finfo.max)).to(encoding)
    return value.view(dtype) if encoding != dtype else value


def view_in(buffer: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`cache`'s view, over `buffer` (a copy of its backing buffer)."""
    return torch.as_strided(
        buffer.view(cache.dtype), cache.size(), cache.stride(), cache.storage_offset()
    )


def expected_after(buffer, caches, kv_cache_config, worker, ids_by_group):
    """`buffer` with the requested blocks of each group's layers set."""
    expected = buffer.clone()
    for group_idx, block_ids in enumerate(ids_by_group):
        for layer in kv_cache_config.kv_cache_groups[group_idx].layer_names:
            cache = caches[layer]
            view = view_in(expected, cache)
            ratio = cache.shape[0] // kv_cache_config.num_blocks
            value = upstream_value(worker, group_idx, layer, cache.dtype)
            for block_id in block_ids:
                view[block_id * ratio : (block_id + 1) * ratio] = value
    return expected


behaviour = pytest.mark.behaviour
pytestmark = pytest.mark.usefixtures("implementation")


@behaviour
@pytest.mark.parametrize("case", list(cases()))
def test_every_layout_vllm_accepts_is_filled_byte_for_byte(base_config, case):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    specs, kernel_block_size = cases()[case]
    accepted = []
    for layout in KVCacheLayout:
        built = allocated(base_config, specs, kernel_block_size, layout)
        if built is None:
            continue
        accepted.append(layout.name)
        config, kv_cache_config, caches = built
        buffer = backing_buffer(caches)
        buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8))
        connector = DecodeBenchConnector(
            config, KVConnectorRole.WORKER, kv_cache_config
        )
        connector.register_kv_caches(caches)
        # Disjoint blocks per group, as vLLM's block pool hands them out.
        num_groups = len(kv_cache_config.kv_cache_groups)
        ids_by_group = [[1 + g, 3 + g * 2, 4 + g * 2] for g in range(num_groups)]
        expected = expected_after(
            buffer, caches, kv_cache_config, connector.connector_worker, ids_by_group
        )
        start_fill(connector, {"r": (tuple(ids_by_group), 48)})
        assert torch.equal(buffer, expected), f"{case}, {layout.name}"
    assert accepted, f"vLLM accepted no layout for {case}"


def attention_and_raw_buffer(resident: str, enable_kv_transfer: bool = True):
    """Layer "l0.attn" and HiSparse resident layer `resident` (a spec without
    layer views), each its own group, in vLLM's allocation: (KV-cache config,
    caches, backing buffer of random bytes). HiSparse plans its resident and
    hot tiers outside KV transfer (``enable_kv_transfer=False``)."""
    from vllm.v1.kv_cache_interface import (
        HiSparseResidentSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    attention_spec = attention(block_size=16)
    page, num_blocks = attention_spec.page_size_bytes, 16
    size = page * num_blocks
    resident_spec = HiSparseResidentSpec(block_size=16, page_size=page)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=size, layers=["l0.attn"], layer_stride=size, block_stride=page
            ),
            KVCacheTensor(
                size=size, layers=[resident], layer_stride=size, block_stride=page
            ),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["l0.attn"], attention_spec),
            KVCacheGroupSpec(
                [resident],
                resident_spec,
                enable_kv_transfer=enable_kv_transfer,
            ),
        ],
    )
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout.LBNHC
    )
    buffer = backing_buffer(caches)
    assert caches[resident].data_ptr() == buffer.data_ptr()
    assert caches[resident].shape == buffer.shape
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8))
    return kv_cache_config, caches, buffer


def test_a_raw_buffer_layer_is_left_alone_with_one_warning(base_config, vllm_log):
    """Specs without layer views (HiSparse) get the raw backing buffer: it has
    no block rows, so nothing is written, and one warning says why, even where
    a step asks for its blocks. vLLM plans such groups outside KV transfer,
    and from 0.34 its scheduler side records no blocks for them: the next
    test, which the patch series pass too, goes that way."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )

    kv_cache_config, caches, buffer = attention_and_raw_buffer("l1.resident")
    config = copy.deepcopy(base_config)
    connector = DecodeBenchConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(caches)
    before = buffer.clone()
    start_fill(connector, {"r": (([], [2, 5]), 32)})
    start_fill(connector, {"s": (([], [7]), 16)})
    assert torch.equal(buffer, before)
    warnings = [r for r in vllm_log if "l1.resident" in r.getMessage()]
    assert len(warnings) == 1 and "raw KV-cache buffer" in warnings[0].getMessage()


@behaviour
def test_a_group_outside_kv_transfer_is_left_alone_from_scheduler_to_worker(
    base_config, vllm_log, implementation, vllm_version
):
    """HiSparse's resident tier as vLLM plans it (outside KV transfer, the raw
    buffer), through the real connector's two roles: the scheduler side
    records a request's blocks, the worker fills that step. The attention
    group's recorded blocks are filled; the raw buffer is untouched. From
    0.34 upstream's scheduler side, which the overlay keeps, records no blocks
    for such a group, so no warning; before, the worker leaves them with
    one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    # Another layer name than the test above: vLLM says a warning once.
    kv_cache_config, caches, buffer = attention_and_raw_buffer(
        "l2.resident", enable_kv_transfer=False
    )
    config = copy.deepcopy(base_config)
    scheduler = DecodeBenchConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    request = make_request("r", prompt_len=40)  # 39 tokens to fill: 3 blocks
    matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
    assert matched == 39
    blocks = tuple([KVCacheBlock(i) for i in ids] for ids in ([2, 5, 9], [3, 4, 6]))
    scheduler.update_state_after_alloc(request, KVCacheBlocks(blocks), matched)
    reqs_to_fill = scheduler.build_connector_meta(None).reqs_to_fill
    ((recorded, _),) = reqs_to_fill.values()
    newer = parse_release(vllm_version) >= (0, 34, 0)
    assert recorded == ([2, 5, 9], [] if newer else [3, 4, 6])

    worker = DecodeBenchConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches(caches)
    expected = buffer.clone()
    view_in(expected, caches["l0.attn"])[[2, 5, 9]] = MEAN
    start_fill(worker, reqs_to_fill)
    assert torch.equal(buffer, expected)
    if implementation == "overlay":
        warnings = [r for r in vllm_log if "l2.resident" in r.getMessage()]
        assert len(warnings) == (0 if newer else 1)


@behaviour
def test_a_host_pool_with_more_blocks_is_filled_by_its_own_count(base_config):
    """A HiSparse host pool (``host_resident``) has
    ``hisparse_host_num_blocks`` blocks, more than ``num_blocks``: its blocks
    beyond ``num_blocks`` are filled too, as upstream fills them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    page, num_blocks, host_blocks = attention(block_size=16).page_size_bytes, 16, 40
    size = page * (num_blocks + host_blocks)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=size,
                layers=["l0.attn"],
                layer_stride=page * num_blocks,
                block_stride=page,
            ),
            KVCacheTensor(
                size=size,
                layers=["l1.host"],
                layer_stride=page * host_blocks,
                block_stride=page,
                offset=page * num_blocks,
                host_resident=True,
            ),
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(["l0.attn"], attention(block_size=16)),
            KVCacheGroupSpec(["l1.host"], attention(block_size=16)),
        ],
        hisparse_host_num_blocks=host_blocks,
    )
    caches = allocate_kv_cache(
        kv_cache_config, torch.device("cpu"), KVCacheLayout.LBNHC
    )
    assert caches["l1.host"].shape[0] == host_blocks
    buffer = backing_buffer(caches)
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8))
    connector = DecodeBenchConnector(
        copy.deepcopy(base_config), KVConnectorRole.WORKER, kv_cache_config
    )
    connector.register_kv_caches(caches)
    expected = buffer.clone()
    view_in(expected, caches["l0.attn"])[[2, 3]] = MEAN
    view_in(expected, caches["l1.host"])[[5, 20, 39]] = MEAN
    start_fill(connector, {"r": (([2, 3], [5, 20, 39, 40]), 48)})
    assert torch.equal(buffer, expected)


def test_groups_whose_pages_are_the_same_memory_are_written_in_one_go(
    base_config, vllm_log, monkeypatch
):
    """vLLM overlays a hybrid's groups on one buffer, so groups of one spec
    have the same pages: a step writes the union of their blocks at once
    (the same bytes as group by group), and says once per group, not per
    layer, that their int8 pages take zeros."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_kvfill_patch import fill

    # Layer names of its own: vLLM says a warning once per process.
    specs = three_group_hybrid(cases()["hybrid"][0]["l1.mamba"], prefix="own")
    config, kv_cache_config, caches = allocated(
        base_config, specs, None, KVCacheLayout.LBNHC
    )
    groups = [group.layer_names for group in kv_cache_config.kv_cache_groups]
    assert groups == [
        ["own0.attn", "own1.attn"],
        ["own2.mamba", "own4.mamba"],
        ["own3.mamba", "own5.mamba"],
    ]
    assert caches["own2.mamba"].data_ptr() == caches["own3.mamba"].data_ptr()
    writes = []
    original = fill.PagesFill.write_

    def counted(pages_fill, block_ids):
        writes.append((pages_fill, sorted(block_ids)))
        return original(pages_fill, block_ids)

    monkeypatch.setattr(fill.PagesFill, "write_", counted)
    buffer = backing_buffer(caches)
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8))
    connector = DecodeBenchConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(caches)
    ids_by_group = [[1, 2, 9], [3, 7], [4, 8]]
    expected = expected_after(
        buffer, caches, kv_cache_config, connector.connector_worker, ids_by_group
    )
    start_fill(connector, {"r": (tuple(ids_by_group), 48)})

    assert torch.equal(buffer, expected)
    assert [ids for _, ids in writes] == [[1, 2, 9], [3, 4, 7, 8]]
    zeroed = [r.getMessage() for r in vllm_log if "integer caches" in r.getMessage()]
    assert len(zeroed) == 2, zeroed
    assert "group 1" in zeroed[0] and "2 layers, own2.mamba ... own4.mamba" in zeroed[0]


def test_ids_outside_the_pool_are_not_written_and_said_once(base_config, vllm_log):
    """Bad input: ids past the pool (or negative) are not written, and one
    warning per write says so, naming the groups written together."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    specs = three_group_hybrid(cases()["hybrid"][0]["l1.mamba"], prefix="outside")
    config, kv_cache_config, caches = allocated(
        base_config, specs, None, KVCacheLayout.LBNHC
    )
    num_blocks = kv_cache_config.num_blocks
    buffer = backing_buffer(caches)
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8))
    connector = DecodeBenchConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    connector.register_kv_caches(caches)
    expected = expected_after(
        buffer, caches, kv_cache_config, connector.connector_worker, [[1, 2], [3], [4]]
    )
    start_fill(connector, {"r": (([1, 2, num_blocks], [3, -1], [4]), 48)})
    start_fill(connector, {"s": (([num_blocks + 5], [], []), 48)})

    assert torch.equal(buffer, expected)
    said = [r.getMessage() for r in vllm_log if "outside the pool" in r.getMessage()]
    assert said == [
        "vllm-kvfill-patch: a step asked for block ids outside the pool of "
        f"{num_blocks} blocks (KV-cache {groups}); not filling those"
        for groups in ("group 0", "groups 1, 2")
    ]
