"""The fill on the real DecodeBenchConnector of the installed vLLM, in process.

Tests marked ``behaviour`` run against two implementations: the overlay on
upstream's file (the default), and upstream's file with a patch from
``patches/`` applied, loaded in its place without the overlay (conftest,
``KVFILL_CONNECTOR_FILE``). The others are about the overlay itself.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import vllm_kvfill_patch
from tests.children import wrapper_count
from tests.helpers import overlay_reverted
from tests.hybrid import (
    ATTENTION_DTYPE,
    ATTENTION_GROUP,
    ATTENTION_LAYER,
    GDN_STATES,
    KDA_STATES,
    LINEAR_GROUP,
    LINEAR_LAYER,
    PAGE_BYTES,
    make_kv_cache_config,
    make_pool,
    make_worker_connector,
    start_fill,
)
from vllm_kvfill_patch import Decision
from vllm_kvfill_patch.releases import parse_release

NUM_BLOCKS = 12


behaviour = pytest.mark.behaviour
pytestmark = pytest.mark.usefixtures("implementation")


def expect_only_pages_changed(pool, before: torch.Tensor, changed: set[int]) -> None:
    pages, old = pool.pages(), before.view(pool.num_blocks, PAGE_BYTES)
    for block_id in range(pool.num_blocks):
        same = torch.equal(pages[block_id], old[block_id])
        assert same != (block_id in changed), f"block {block_id}"


@contextlib.contextmanager
def fp8_connector(config, pool, cache_dtype="fp8_e4m3"):
    """A connector over `pool` whose attention cache is fp8 as uint8."""
    original = config.cache_config.cache_dtype
    config.cache_config.cache_dtype = cache_dtype
    try:
        kv_cache_config = make_kv_cache_config(pool, fp8_attention=True)
        yield make_worker_connector(config, pool, kv_cache_config)
    finally:
        config.cache_config.cache_dtype = original


def test_without_the_patch_upstream_fails_on_a_list_state_cache(
    vllm_config_for, vllm_version
):
    # Building a VllmConfig loads vLLM's plugins, this package's among them.
    vllm_config = vllm_config_for()
    vllm_kvfill_patch.revert()
    pool = make_pool(NUM_BLOCKS)
    connector = make_worker_connector(vllm_config, pool)
    before = pool.raw.clone()
    if parse_release(vllm_version) < (0, 24, 0):
        with pytest.raises(AttributeError, match="'list' object has no attribute"):
            start_fill(connector, {"r": (([1], [2]), 16)})
    else:
        # #45080: each state tensor filled whole, over every block's page.
        start_fill(connector, {"r": (([1], [2]), 16)})
        expect_only_pages_changed(pool, before, set(range(NUM_BLOCKS)))


@behaviour
@pytest.mark.parametrize(
    "state_shapes,states_as",
    [(GDN_STATES, list), (KDA_STATES, tuple)],
    ids=["gdn-list", "kda-tuple"],
)
def test_each_layer_gets_its_own_groups_rows_and_nothing_else(
    vllm_config_for, state_shapes, states_as
):
    pool = make_pool(NUM_BLOCKS, state_shapes, states_as)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    before = pool.raw.clone()

    start_fill(connector, {"r1": (([3, 4], [7]), 32)})

    expect_only_pages_changed(pool, before, {3, 4, 7})
    for block_id in (3, 4):
        assert (pool.attention_block(block_id) == 0.5).all()
    for state in pool.state_block(7):
        assert (state == 0.5).all()
    # The Mamba state page's padding beyond the states is not state: untouched.
    state_bytes = sum(torch.Size(s).numel() for s in state_shapes) * 4
    assert torch.equal(
        pool.pages()[7][state_bytes:],
        before.view(NUM_BLOCKS, PAGE_BYTES)[7][state_bytes:],
    )


def test_the_fill_uses_the_real_groups_and_leaves_upstreams_map_alone(
    vllm_config_for,
):
    from vllm_kvfill_patch.worker_step import current_layout

    with overlay_reverted():
        upstream_map = make_worker_connector(
            vllm_config_for(), make_pool(NUM_BLOCKS)
        ).connector_worker.group_to_layers
    connector = make_worker_connector(vllm_config_for(), make_pool(NUM_BLOCKS))
    start_fill(connector, {"r": (([2], [3]), 16)})
    worker = connector.connector_worker
    assert worker.group_to_layers == upstream_map
    assert current_layout(worker).group_to_layers == {
        ATTENTION_GROUP: [ATTENTION_LAYER],
        LINEAR_GROUP: [LINEAR_LAYER],
    }


@behaviour
def test_a_second_request_leaves_the_first_requests_blocks_alone(vllm_config_for):
    pool = make_pool(NUM_BLOCKS)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    start_fill(connector, {"r1": (([1, 2], [3]), 32)})
    after_first = pool.raw.clone()
    start_fill(connector, {"r2": (([4, 5], [6]), 32)})
    expect_only_pages_changed(pool, after_first, {4, 5, 6})


@behaviour
def test_random_fill_gives_normal_values(vllm_config_for):
    pool = make_pool(64)
    connector = make_worker_connector(
        vllm_config_for(fill_mean=0.25, fill_std=0.5), pool
    )
    before = pool.raw.clone()
    attention_ids = list(range(1, 40))
    start_fill(connector, {"r": ((attention_ids, [50]), 16 * 39)})
    expect_only_pages_changed(pool, before, {*attention_ids, 50})
    values = torch.stack([pool.attention_block(b) for b in attention_ids]).float()
    assert abs(values.mean().item() - 0.25) < 0.02
    assert abs(values.std().item() - 0.5) < 0.02
    conv_state = pool.state_block(50)[0]
    assert conv_state.unique().numel() > 100


@behaviour
@pytest.mark.kv_first_layout
def test_flashattention_kv_first_layout_fills_the_block_dimension(vllm_config_for):
    pool = make_pool(NUM_BLOCKS, kv_first=True)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    attention = pool.caches[ATTENTION_LAYER]
    before = attention.clone()
    start_fill(connector, {"r": (([1, 5], []), 32)})
    for block_id in range(NUM_BLOCKS):
        row, old = attention[:, block_id], before[:, block_id]
        if block_id in (1, 5):
            assert (row == 0.5).all()
        else:
            assert torch.equal(row.view(torch.int16), old.view(torch.int16))


@behaviour
@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("fill_std", [0.0, 0.5], ids=["constant", "random"])
def test_a_kernel_split_cache_gets_all_kernel_rows_of_each_block(
    vllm_config_for, ratio, fill_std
):
    pool = make_pool(NUM_BLOCKS, kernel_split=ratio)
    config = vllm_config_for(fill_mean=0.5, fill_std=fill_std)
    connector = make_worker_connector(config, pool)
    before = pool.raw.clone()
    start_fill(connector, {"r1": (([0, 3, 4, 3, NUM_BLOCKS], [7]), 32)})
    # Manager block b is kernel rows b*r .. b*r + r - 1: exactly page b.
    expect_only_pages_changed(pool, before, {3, 4, 7})
    for block_id in (3, 4):
        filled = pool.attention_block(block_id)
        if fill_std == 0:
            assert (filled == 0.5).all()
        else:
            assert filled.unique().numel() > 100


@behaviour
@pytest.mark.kv_first_layout
@pytest.mark.parametrize("ratio", [2, 4])
def test_flashattention_kv_first_kernel_split_fills_each_blocks_rows(
    vllm_config_for, ratio
):
    pool = make_pool(NUM_BLOCKS, kv_first=True, kernel_split=ratio)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    attention = pool.caches[ATTENTION_LAYER]
    before = attention.clone()
    start_fill(connector, {"r": (([1, 5], []), 32)})
    filled_rows = {b * ratio + j for b in (1, 5) for j in range(ratio)}
    for row in range(NUM_BLOCKS * ratio):
        new, old = attention[:, row], before[:, row]
        if row in filled_rows:
            assert (new == 0.5).all(), row
        else:
            assert torch.equal(new.view(torch.int16), old.view(torch.int16)), row


@behaviour
@pytest.mark.parametrize("ratio", [2, 4])
def test_kernel_split_fp8_and_mla_caches(vllm_config_for, ratio):
    config = vllm_config_for(fill_mean=0.5)
    pool = make_pool(NUM_BLOCKS)
    # fp8 stored as uint8, split; and an MLA-shaped (N*r, tokens, head) cache.
    fp8_cache = torch.zeros(
        NUM_BLOCKS * ratio, 2, 16 // ratio, 1, 64, dtype=torch.uint8
    )
    pool.caches[ATTENTION_LAYER] = fp8_cache
    with fp8_connector(config, pool) as connector:
        start_fill(connector, {"r": (([2], []), 16)})
        mla = torch.zeros(NUM_BLOCKS * ratio, 16 // ratio, 72, dtype=torch.uint8)
        connector.connector_worker.kv_caches[ATTENTION_LAYER] = mla
        start_fill(connector, {"r2": (([5], []), 16)})
    byte = torch.tensor(0.5).to(torch.float8_e4m3fn).view(torch.uint8).item()
    for cache, block in ((fp8_cache, 2), (mla, 5)):
        rows = list(range(block * ratio, block * ratio + ratio))
        assert (cache[rows] == byte).all()
        others = [r for r in range(NUM_BLOCKS * ratio) if r not in rows]
        assert not cache[others].any()


def step_requests(count: int, num_blocks: int) -> dict:
    """`count` requests of a step: 3 attention blocks and 1 state block each,
    with a duplicate id across requests, the null block, an out-of-range id."""
    requests = {}
    for i in range(count):
        attention = [1 + (3 * i + j) % (num_blocks // 2) for j in range(3)]
        state = [num_blocks // 2 + i % (num_blocks // 2)]
        requests[f"r{i}"] = ((attention + [0, num_blocks + i], state), 16 * 4)
    return requests


def union_of(requests: dict, num_blocks: int) -> set[int]:
    return {
        b
        for block_ids_per_group, _ in requests.values()
        for ids in block_ids_per_group
        for b in ids
        if 0 < b < num_blocks
    }


@behaviour
@pytest.mark.parametrize("count", [1, 8, 40])
def test_a_step_fills_exactly_the_union_of_its_requests_blocks(vllm_config_for, count):
    pool = make_pool(64)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    before = pool.raw.clone()
    requests = step_requests(count, 64)
    start_fill(connector, requests)
    expect_only_pages_changed(pool, before, union_of(requests, 64))
    for block_id in union_of(requests, 64) & set(range(1, 32)):
        assert (pool.attention_block(block_id) == 0.5).all()


@pytest.fixture
def tensor_fills(monkeypatch):
    """Counts the overlay's fill calls: one per tensor, list of states or group view."""
    from vllm_kvfill_patch import worker_step

    calls = []
    targets = [(worker_step, "fill_cache_blocks_"), (worker_step, "fill_state_blocks_")]
    for owner, name in [*targets, (worker_step.PagesFill, "write_")]:
        original = getattr(owner, name)

        def counted(*args, _original=original, **kwargs):
            calls.append(args[0])
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    return calls


def test_fill_calls_per_step_do_not_grow_with_the_requests(
    vllm_config_for, tensor_fills
):
    pool = make_pool(64)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    counts = []
    for count in (1, 8, 40):
        tensor_fills.clear()
        start_fill(connector, step_requests(count, 64))
        counts.append(len(tensor_fills))
    # One attention layer and one list of states: two fills a step.
    assert counts == [2, 2, 2]


@behaviour
def test_a_step_calls_fill_blocks_at_most_once_per_group(
    vllm_config_for, monkeypatch, implementation
):
    # The patch files fill a step through _fill_blocks, once per group; the
    # overlay does not call it at all (test_fill_calls_per_step_...).
    pool = make_pool(64)
    before = pool.raw.clone()
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    worker = connector.connector_worker
    calls = []
    fill_blocks = worker._fill_blocks

    def counted(group_idx, block_ids, num_tokens):
        calls.append(group_idx)
        return fill_blocks(group_idx, block_ids, num_tokens)

    monkeypatch.setattr(worker, "_fill_blocks", counted)
    requests = step_requests(40, 64)
    start_fill(connector, requests)
    assert sorted(calls) == ([] if implementation == "overlay" else [0, 1])
    expect_only_pages_changed(pool, before, union_of(requests, 64))


def test_a_step_is_byte_identical_to_filling_request_by_request(vllm_config_for):
    config = vllm_config_for(fill_mean=0.5)
    requests = step_requests(40, 64)
    by_step, by_request = make_pool(64), make_pool(64)
    by_request.raw.copy_(by_step.raw)
    start_fill(make_worker_connector(config, by_step), requests)
    connector = make_worker_connector(config, by_request)
    for req_id, request in requests.items():
        start_fill(connector, {req_id: request})
    assert torch.equal(by_step.raw, by_request.raw)


@behaviour
def test_a_random_step_fill_keeps_its_statistics(vllm_config_for):
    pool = make_pool(64)
    connector = make_worker_connector(
        vllm_config_for(fill_mean=0.25, fill_std=0.5), pool
    )
    requests = step_requests(40, 64)
    start_fill(connector, requests)
    attention_ids = sorted(union_of(requests, 64) & set(range(1, 32)))
    values = torch.stack([pool.attention_block(b) for b in attention_ids]).float()
    assert abs(values.mean().item() - 0.25) < 0.02
    assert abs(values.std().item() - 0.5) < 0.02


@behaviour
def test_invalid_null_and_duplicate_ids(vllm_config_for):
    pool = make_pool(NUM_BLOCKS)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    before = pool.raw.clone()
    start_fill(connector, {"r": (([0, -1, NUM_BLOCKS, 99, 2, 2], []), 32)})
    expect_only_pages_changed(pool, before, {2})
    start_fill(connector, {"r2": (([], []), 0)})
    expect_only_pages_changed(pool, before, {2})


def test_ids_outside_the_pool_are_said_once_per_group(vllm_config_for, vllm_log):
    blocks = NUM_BLOCKS + 1  # a pool size of its own: vLLM warns once per process
    pool = make_pool(blocks)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    before = pool.raw.clone()
    start_fill(connector, {"r": (([3, blocks, 99], [-1, 4]), 32)})
    start_fill(connector, {"s": (([5, blocks + 1], [0]), 32)})
    expect_only_pages_changed(pool, before, {3, 4, 5})
    said = [r for r in vllm_log if "outside the pool" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING] * 2
    assert [r.getMessage() for r in said] == [
        f"vllm-kvfill-patch: a step asked for block ids outside the pool of "
        f"{blocks} blocks (KV-cache group {group}); not filling those"
        for group in (ATTENTION_GROUP, LINEAR_GROUP)
    ]


def test_raw_mamba_pages_are_written_up_to_their_states_not_the_padding(
    vllm_config_for,
):
    """vLLM 0.27 - 0.28 register a Mamba layer as its raw int8 pages,
    ``(num_blocks, 1, 1, page)``, the page padded to the attention page; its
    spec tells the states' size: the bytes after them are never read."""
    pool = make_pool(NUM_BLOCKS)
    kv_cache_config = make_kv_cache_config(pool)
    pool.caches[LINEAR_LAYER] = pool.raw.view(torch.int8).view(
        NUM_BLOCKS, 1, 1, PAGE_BYTES
    )
    connector = make_worker_connector(
        vllm_config_for(fill_mean=0.5), pool, kv_cache_config
    )
    before = pool.raw.clone().view(NUM_BLOCKS, PAGE_BYTES)
    start_fill(connector, {"r": (([2], [5, 7]), 16)})
    state_bytes = sum(torch.Size(s).numel() for s in GDN_STATES) * 4
    assert 0 < state_bytes < PAGE_BYTES
    pages = pool.pages()
    for block in (5, 7):
        assert not pages[block][:state_bytes].any()  # int8 pages: zeros
        assert torch.equal(pages[block][state_bytes:], before[block][state_bytes:])
    expect_only_pages_changed(pool, before.flatten(), {2, 5, 7})


def test_a_fill_asked_for_while_a_graph_is_captured_is_not_issued(
    vllm_config_for, vllm_log, monkeypatch
):
    """A fill captured into a CUDA graph would be replayed with this step's
    rows; the capture probe is CUDA's, so here it is made to answer yes."""
    from vllm_kvfill_patch import worker_step

    pool = make_pool(NUM_BLOCKS)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    before = pool.raw.clone()
    monkeypatch.setattr(worker_step, "capturing", lambda: True)
    start_fill(connector, {"r1": (([1, 2], [3]), 32)})
    start_fill(connector, {"r2": (([4], [5]), 16)})
    expect_only_pages_changed(pool, before, set())
    said = [r for r in vllm_log if "capturing" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING]

    monkeypatch.setattr(worker_step, "capturing", lambda: False)
    start_fill(connector, {"r3": (([6], [7]), 16)})
    expect_only_pages_changed(pool, before, {6, 7})


def test_without_cuda_the_capture_probe_answers_no_without_initialising_it():
    from vllm_kvfill_patch.worker_step import capturing

    initialised = torch.cuda.is_initialized()
    assert capturing() is False
    assert torch.cuda.is_initialized() == initialised


def test_a_step_before_registration_gets_upstreams_own_error(vllm_config_for):
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )

    pool = make_pool(NUM_BLOCKS)
    connector = DecodeBenchConnector(
        vllm_config_for(), KVConnectorRole.WORKER, make_kv_cache_config(pool)
    )
    errors = []
    for upstream in (False, True):
        reverted = overlay_reverted() if upstream else contextlib.nullcontext()
        with reverted, pytest.raises(AssertionError) as raised:
            start_fill(connector, {"r": (([1], [2]), 16)})
        errors.append(str(raised.value))
    assert errors[0] == errors[1]
    assert not hasattr(connector.connector_worker, "_kvfill_layout")


def test_a_state_without_a_block_dimension_is_left_alone_and_said_once(
    vllm_config_for, vllm_log
):
    pool = make_pool(NUM_BLOCKS)
    odd = torch.full((5, 3), 7.0)
    pool.caches[LINEAR_LAYER] = [*pool.caches[LINEAR_LAYER], odd]
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    before = pool.raw.clone()
    start_fill(connector, {"r": (([3], [4]), 16)})
    start_fill(connector, {"s": (([5], [6]), 16)})
    expect_only_pages_changed(pool, before, {3, 4, 5, 6})
    assert (odd == 7.0).all()
    said = [r.getMessage() for r in vllm_log if "(5, 3)" in r.getMessage()]
    assert said == [
        f"vllm-kvfill-patch: a state tensor of layer {LINEAR_LAYER}, shape (5, 3), "
        f"has no block dimension (expected num_blocks={NUM_BLOCKS} along dim 0); "
        "not filling it"
    ]


def test_a_pipeline_stage_fills_its_own_layers_and_names_no_other(
    vllm_config_for, vllm_log
):
    # The KV-cache groups name every layer of the model; a pipeline-parallel
    # stage registers only its own.
    pool = make_pool(NUM_BLOCKS)
    kv_cache_config = make_kv_cache_config(pool)
    for group in kv_cache_config.kv_cache_groups:
        group.layer_names.append(group.layer_names[0].replace("layers.", "layers.9"))
    connector = make_worker_connector(
        vllm_config_for(fill_mean=0.5), pool, kv_cache_config
    )
    before = pool.raw.clone()
    start_fill(connector, {"r": (([3], [4]), 32)})
    expect_only_pages_changed(pool, before, {3, 4})
    assert (pool.attention_block(3) == 0.5).all()
    assert [r.getMessage() for r in vllm_log if "layers.9" in r.getMessage()] == []


@behaviour
def test_non_tensor_cache_warns_once_and_other_layers_still_fill(
    vllm_config_for, vllm_log
):
    pool = make_pool(NUM_BLOCKS)
    pool.caches["model.layers.2.odd"] = {"not": "a tensor"}
    kv_cache_config = make_kv_cache_config(pool)
    kv_cache_config.kv_cache_groups[ATTENTION_GROUP].layer_names.append(
        "model.layers.2.odd"
    )
    connector = make_worker_connector(
        vllm_config_for(fill_mean=0.5), pool, kv_cache_config
    )
    before = pool.raw.clone()
    start_fill(connector, {"r1": (([1], [2]), 16)})
    start_fill(connector, {"r2": (([3], [4]), 16)})
    warnings = [r for r in vllm_log if "model.layers.2.odd" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "dict" in warnings[0].getMessage()
    expect_only_pages_changed(pool, before, {1, 2, 3, 4})


@behaviour
def test_fp8_cache_dtype_writes_the_fp8_encoding(vllm_config_for):
    config = vllm_config_for(fill_mean=0.5)
    pool = make_pool(NUM_BLOCKS)
    fp8_cache = torch.zeros(NUM_BLOCKS, 2, 16, 1, 64, dtype=torch.uint8)
    pool.caches[ATTENTION_LAYER] = fp8_cache
    with fp8_connector(config, pool) as connector:
        start_fill(connector, {"r": (([2], []), 16)})
    expected = torch.tensor(0.5).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert (fp8_cache[2] == expected).all()
    assert not fp8_cache[[0, 1, *range(3, NUM_BLOCKS)]].any()


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e4m3"])
def test_plain_fp8_is_written_in_the_platforms_own_format(
    vllm_config_for, monkeypatch, cache_dtype
):
    # ROCm's MI300 stores fp8 KV caches as e4m3fnuz (its fp8_dtype()): what
    # 0.31+'s worker decides per layer, and the overlay decides so before.
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "fp8_dtype", lambda: torch.float8_e4m3fnuz)
    pool = make_pool(NUM_BLOCKS)
    fp8_cache = torch.zeros(NUM_BLOCKS, 2, 16, 1, 64, dtype=torch.uint8)
    pool.caches[ATTENTION_LAYER] = fp8_cache
    config = vllm_config_for(fill_mean=0.5)
    with fp8_connector(config, pool, cache_dtype) as connector:
        start_fill(connector, {"r": (([2], []), 16)})
    expected = torch.tensor(0.5).to(torch.float8_e4m3fnuz).view(torch.uint8).item()
    assert expected != torch.tensor(0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    assert (fp8_cache[2] == expected).all()
    assert not fp8_cache[[0, 1, *range(3, NUM_BLOCKS)]].any()


def test_fp8_kinds_other_than_plain_fp8_get_no_encoding():
    from vllm_kvfill_patch.worker_step import fp8_encoding

    # Packed with their scales, or out of tree: zeros, as 0.31+ decides.
    for packed in ("fp8_ds_mla", "fp8_per_token_head", "fp8_inc"):
        assert fp8_encoding(packed) is None, packed
    assert fp8_encoding("fp8_e5m2") is torch.float8_e5m2
    assert fp8_encoding("auto") is None


@pytest.mark.parametrize("fill_std", [0.0, 0.1], ids=["constant", "random"])
def test_a_float8_cache_is_written_in_its_own_format(vllm_config_for, fill_std):
    # Many runs of blocks: one indexed write, which takes no float8 dtype on
    # the CPU (upstream's own index_put does).
    blocks = 2 * NUM_BLOCKS
    pool = make_pool(blocks)
    cache = torch.zeros(blocks, 2, 16, 1, 64, dtype=torch.float8_e4m3fn)
    pool.caches[ATTENTION_LAYER] = cache
    config = vllm_config_for(fill_mean=0.5, fill_std=fill_std)
    connector = make_worker_connector(config, pool)
    requested = list(range(1, blocks, 2))
    start_fill(connector, {"r": ((requested, []), 16)})
    values = cache.float()  # float8 has no indexing or comparisons on the CPU
    assert not values[list(range(0, blocks, 2))].any()
    written = values[requested]
    if fill_std == 0:
        assert (written == 0.5).all()
    else:
        assert abs(written.mean().item() - 0.5) < 0.01
        assert abs(written.std().item() - 0.1) < 0.01


@behaviour
@pytest.mark.parametrize("fill_std", [0.0, 1.0], ids=["constant", "random"])
def test_an_out_of_range_mean_gives_the_largest_finite_value(vllm_config_for, fill_std):
    pool = make_pool(NUM_BLOCKS)
    connector = make_worker_connector(
        vllm_config_for(fill_mean=1e39, fill_std=fill_std), pool
    )
    before = pool.raw.clone()
    start_fill(connector, {"r": (([2], []), 16)})
    largest = torch.finfo(ATTENTION_DTYPE).max
    assert (pool.attention_block(2) == largest).all()
    expect_only_pages_changed(pool, before, {2})


@behaviour
def test_an_out_of_range_mean_in_an_fp8_cache_is_its_largest_finite_value(
    vllm_config_for,
):
    pool = make_pool(NUM_BLOCKS)
    fp8_cache = torch.zeros(NUM_BLOCKS, 2, 16, 1, 64, dtype=torch.uint8)
    pool.caches[ATTENTION_LAYER] = fp8_cache
    with fp8_connector(vllm_config_for(fill_mean=1e6), pool) as connector:
        start_fill(connector, {"r": (([2], []), 16)})
    largest = torch.finfo(torch.float8_e4m3fn).max
    assert (fp8_cache[2].view(torch.float8_e4m3fn).float() == largest).all()
    assert not fp8_cache[[0, 1, *range(3, NUM_BLOCKS)]].any()


def test_revert_restores_the_original_function_objects():
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )

    original_load = DecodeBenchConnector.__dict__["start_load_kv"].__wrapped__
    assert vllm_kvfill_patch.revert().decision is Decision.REVERTED
    assert DecodeBenchConnector.__dict__["start_load_kv"] is original_load
    assert vllm_kvfill_patch.apply().decision is Decision.APPLIED
    assert DecodeBenchConnector.__dict__["start_load_kv"].__wrapped__ is original_load


def test_apply_from_eight_threads_installs_one_wrapper():
    import threading

    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )

    vllm_kvfill_patch.revert()
    barrier = threading.Barrier(8)

    def race():
        barrier.wait()
        vllm_kvfill_patch.apply()

    threads = [threading.Thread(target=race) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrapper_count(DecodeBenchConnector.__dict__["start_load_kv"]) == 1
    assert vllm_kvfill_patch.status().decision is Decision.APPLIED


@behaviour
def test_fill_values_are_the_cache_dtype(vllm_config_for):
    pool = make_pool(NUM_BLOCKS)
    connector = make_worker_connector(vllm_config_for(), pool)
    start_fill(connector, {"r": (([1], [2]), 16)})
    default_mean = torch.tensor(0.015, dtype=ATTENTION_DTYPE)
    assert (pool.attention_block(1) == default_mean).all()
