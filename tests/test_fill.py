"""fill.py on its own: property tests against an obviously-correct reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_kvfill_patch import fill
from vllm_kvfill_patch.fill import FillValue, Written

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference_rows(block_ids, num_blocks):
    """The block rows a correct fill writes: valid, non-null, each once."""
    return sorted({b for b in block_ids if 0 < b < num_blocks})


def fill_byte(value: float, encoding: torch.dtype) -> int:
    return int(torch.tensor(value).to(encoding).view(torch.uint8).item())


def assert_rows(before, after, dim, rows, expected_row):
    """Rows `rows` along `dim` equal `expected_row`; every other row unchanged."""
    for b in range(after.shape[dim]):
        row = after.select(dim, b)
        expected = expected_row(row) if b in rows else before.select(dim, b)
        assert torch.equal(row, expected), f"row {b}"


block_id_lists = st.lists(st.integers(min_value=-3, max_value=40), max_size=30)


LAYOUTS = {
    # name: (shape for num_blocks N, split ratio r, kernel block tokens t;
    #        the block dimension the layout puts blocks on)
    "blocks-first": (lambda n, r, t: [n * r, 2, t, 3], 0),
    "kv-first": (lambda n, r, t: [2, n * r, t, 3], 1),  # FlashAttention <= 0.22
    "mla": (lambda n, r, t: [n * r, t, 5], 0),
    "cpu": (lambda n, r, t: [n * r, 1, t, 4], 0),
    # Rows of whole 16-byte words for every dtype: constant fills of many runs
    # go through complex128 views (kv-first: through the moved block dim).
    "kv-first, words": (lambda n, r, t: [2, n * r, t, 16], 1),
    "blocks-first, words": (lambda n, r, t: [n * r, t, 16], 0),
}


def expected_rows(block_ids, num_blocks, ratio):
    """Kernel rows of the valid, non-null requested manager blocks."""
    blocks = reference_rows(block_ids, num_blocks)
    return {b * ratio + j for b in blocks for j in range(ratio)}


@settings(max_examples=200, deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    num_blocks=st.integers(min_value=3, max_value=20),
    ratio=st.sampled_from([1, 2, 4]),
    kernel_tokens=st.sampled_from([4, 16]),
    block_ids=block_id_lists,
    dtype=st.sampled_from(DTYPES + [torch.uint8, torch.float8_e4m3fn]),
    std=st.sampled_from([0.0, 1.0]),
)
def test_fill_writes_exactly_the_kernel_rows_of_the_requested_blocks(
    layout, num_blocks, ratio, kernel_tokens, block_ids, dtype, std
):
    make_shape, dim = LAYOUTS[layout]
    shape = make_shape(num_blocks, ratio, kernel_tokens)
    cache = torch.randint(0, 200, shape).to(dtype)
    before = cache.clone()
    encoding = torch.float8_e4m3fn if dtype == torch.uint8 else None
    value = FillValue(0.5, std, encoding)
    report = fill.fill_cache_blocks_(
        cache,
        fill.BlockSet(block_ids, num_blocks),
        value,
        block_size=kernel_tokens * ratio,
    )
    rows = expected_rows(block_ids, num_blocks, ratio)
    assert report.written is (Written.ROWS if rows else Written.NOTHING)
    constant = fill_byte(0.5, encoding) if encoding else 0.5
    if dtype == torch.float8_e4m3fn:  # compared as bytes: no float8 eq on the CPU
        cache, before = cache.view(torch.uint8), before.view(torch.uint8)
        constant = fill_byte(0.5, dtype)
    for row in range(num_blocks * ratio):
        new, old = cache.select(dim, row), before.select(dim, row)
        if row not in rows:
            assert torch.equal(new, old), f"row {row} changed"
        elif std == 0:
            assert (new == constant).all(), f"row {row}"
        else:
            assert not torch.equal(new, old) or new.numel() == 0, f"row {row}"


@pytest.mark.parametrize("ratio", [2, 4])
def test_split_ratio_without_a_block_size_comes_from_the_dimension(ratio):
    cache = torch.zeros(6 * ratio, 16 // ratio, 8)
    fill.fill_cache_blocks_(cache, fill.BlockSet([2, 5], 6), FillValue(1.0))
    filled = {r for r in range(6 * ratio) if cache[r].any()}
    assert filled == {b * ratio + j for b in (2, 5) for j in range(ratio)}


def test_a_split_that_the_block_size_contradicts_is_not_filled():
    # 12 rows for 6 blocks would be a split by 2, into kernel blocks of
    # 8 tokens; the tensor has no 8-token dimension, so it is not one.
    cache = torch.zeros(12, 2, 16, 4)
    report = fill.fill_cache_blocks_(
        cache, fill.BlockSet([1], 6), FillValue(1.0), block_size=16
    )
    assert report.written is Written.NO_BLOCK_DIM
    assert not cache.any()


def test_kv_first_with_two_blocks_takes_dim_zero_as_documented():
    cache = torch.zeros(2, 2, 16, 4)
    assert fill.find_block_dim(cache.shape, 2, 16) == fill.BlockDim(0, 1)


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(min_value=2, max_value=24),
    row_shape=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=3),
    block_ids=block_id_lists,
    dtype=st.sampled_from(DTYPES),
    noise_bytes=st.sampled_from([4, 64, 1024, fill.NOISE_BYTES]),
)
def test_random_fill_changes_only_requested_rows(
    num_blocks, row_shape, block_ids, dtype, noise_bytes
):
    cache = torch.full([num_blocks, *row_shape], 1000.0, dtype=dtype)
    before = cache.clone()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fill, "NOISE_BYTES", noise_bytes)
        fill.fill_cache_blocks_(
            cache, fill.BlockSet(block_ids, num_blocks), FillValue(0.0, 1.0)
        )
    rows = reference_rows(block_ids, num_blocks)
    for b in range(num_blocks):
        if b in rows:
            # Normal(0, 1) samples are never the sentinel 1000.
            assert (cache[b].float().abs() < 100).all()
        else:
            assert torch.equal(cache[b], before[b])


def test_random_fill_is_normal_distributed():
    cache = torch.zeros(8, 64, 1024)
    fill.fill_cache_blocks_(cache, fill.BlockSet([2, 3, 5], 8), FillValue(0.5, 0.25))
    filled = cache[[2, 3, 5]]
    assert abs(filled.mean().item() - 0.5) < 0.01
    assert abs(filled.std().item() - 0.25) < 0.01
    assert filled.unique().numel() > 1000
    assert torch.equal(cache[[0, 1, 4, 6, 7]], torch.zeros(5, 64, 1024))


@pytest.mark.parametrize("encoding", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("std", [0.0, 0.5])
def test_fp8_cache_stored_as_uint8_gets_the_encoded_value(encoding, std):
    cache = torch.full((6, 4, 8), 0xAB, dtype=torch.uint8)
    fill.fill_cache_blocks_(
        cache, fill.BlockSet([1, 4], 6), FillValue(0.015, std, encoding)
    )
    for b in (0, 2, 3, 5):
        assert (cache[b] == 0xAB).all()
    decoded = cache[[1, 4]].view(encoding).float()
    if std == 0:
        assert (cache[[1, 4]] == fill_byte(0.015, encoding)).all()
    else:
        assert decoded.std() > 0.1 and abs(decoded.mean()) < 0.3


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.uint8, torch.bool])
def test_integer_cache_is_zero_filled_and_reported(dtype):
    cache = torch.ones((5, 3), dtype=dtype)
    report = fill.fill_cache_blocks_(
        cache, fill.BlockSet([2], 5), FillValue(0.015, 0.3)
    )
    assert report == fill.FillReport(Written.ROWS, zeroed=True)
    assert not cache[2].any()
    assert cache[[0, 1, 3, 4]].all()


@settings(max_examples=100, deadline=None)
@given(block_ids=block_id_lists, ratio=st.sampled_from([1, 2, 3]))
def test_row_index_lists_every_row_of_the_runs_once_in_order(block_ids, ratio):
    rows = fill.BlockSet(block_ids, 30).rows(ratio)
    expected = [
        b * ratio + j for b in reference_rows(block_ids, 30) for j in range(ratio)
    ]
    assert rows.index(torch.device("cpu")).tolist() == expected
    assert rows.num_rows == len(expected)


@settings(max_examples=100, deadline=None)
@given(block_ids=block_id_lists, count=st.integers(min_value=0, max_value=12))
def test_has_runs_counts_as_far_as_asked(block_ids, count):
    rows = fill.BlockSet(block_ids, 30).rows()
    runs = fill.BlockSet(block_ids, 30).rows().runs  # on a RowRuns of its own
    assert rows.has_runs(count) == (len(runs) >= count)
    assert rows.has_runs(count) == (len(rows.runs) >= count)  # runs worked out


def test_block_runs_normalise_ids():
    blocks = fill.BlockSet([5, 3, 4, 4, 9, -1, 0, 12, 10], 11)
    assert blocks.ids == [3, 4, 5, 9, 10]
    assert blocks.outside == [-1, 12]  # the null block is not bad input
    assert blocks.rows().runs == [(3, 3), (9, 2)]
    assert fill.BlockSet([], 11).rows().runs == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_rows_of_one_element_are_not_merged_into_words(dtype):
    # A state of one value per block: 16-byte words would span blocks.
    raw = torch.randint(0, 256, (64 * dtype.itemsize,), dtype=torch.uint8)
    state = raw.view(dtype)
    before = state.clone()
    ids = list(range(1, 64, 2))
    fill.fill_state_blocks_([state], fill.BlockSet(ids, 64), FillValue(2.0))
    expected = before.clone()
    expected[ids] = 0 if dtype == torch.uint8 else 2.0
    assert torch.equal(state.view(torch.uint8), expected.view(torch.uint8))


def test_null_block_is_never_filled():
    cache = torch.zeros(4, 2)
    report = fill.fill_cache_blocks_(cache, fill.BlockSet([0], 4), FillValue(1.0))
    assert report.written is Written.NOTHING
    assert not cache.any()


@pytest.mark.parametrize("row_elements", [3, 16384], ids=["small", "32 KiB plus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("std", [0.0, 1.0])
def test_many_scattered_blocks(row_elements, dtype, std):
    # Small rows take one indexed kernel; rows of 32 KiB and more a loop (CPU)
    # unless a constant fill writes them as 16-byte words, indexed. The
    # indexed kernels take no float8 dtype on the CPU: its bytes are written.
    cache = torch.full((64, row_elements), 256.0, dtype=dtype)
    ids = list(range(1, 64, 2))
    fill.fill_cache_blocks_(cache, fill.BlockSet(ids, 64), FillValue(2.0, std))
    values = cache.float()  # float8 has no indexing or comparisons on the CPU
    filled = values[ids]
    assert (filled == 2).all() if std == 0 else (filled.abs() < 100).all()
    assert (values[list(range(0, 64, 2))] == 256).all()


def test_float8_rows_that_are_not_whole_words_are_written_as_bytes():
    # Rows of 15 bytes: no 16-byte words, so one index_fill_ on the bytes.
    cache = torch.zeros(64, 3, 5, dtype=torch.float8_e5m2)
    ids = list(range(1, 64, 2))
    fill.fill_cache_blocks_(cache, fill.BlockSet(ids, 64), FillValue(0.015))
    written = cache.view(torch.uint8)
    assert (written[ids] == fill_byte(0.015, torch.float8_e5m2)).all()
    assert not written[list(range(0, 64, 2))].any()


@pytest.mark.parametrize("first,second", [(-0.0, 0.0), (0.0, -0.0)])
def test_zero_and_negative_zero_are_each_written_as_their_own_bytes(first, second):
    # Equal as numbers, so a cache of words by value would hand the second
    # the first's (or an earlier test's) word: bf16 -0.0 is 0x8000, and a
    # zero-filled ring may hold integers.
    for mean in (first, second):
        cache = torch.ones(16, 4, 8, dtype=torch.bfloat16)
        ids = list(range(1, 16, 2))  # 8 runs: one index_fill_ of words
        fill.fill_cache_blocks_(cache, fill.BlockSet(ids, 16), FillValue(mean))
        expected = torch.tensor(mean, dtype=torch.bfloat16).view(torch.int16)
        assert (cache[ids].view(torch.int16) == expected).all(), mean


def test_tensor_without_block_dimension_is_left_alone():
    cache = torch.zeros(3, 5)
    report = fill.fill_cache_blocks_(cache, fill.BlockSet([1], 7), FillValue(1.0))
    assert report.written is Written.NO_BLOCK_DIM
    assert not cache.any()


def test_state_fill_takes_rows_of_block_indexed_states_and_leaves_others():
    pool = torch.zeros(10 * 12)
    conv = torch.as_strided(pool, (10, 2, 3), (12, 3, 1), 0)
    ssm = torch.as_strided(pool, (10, 6), (12, 1), 6)
    no_block_dim = torch.zeros(4, 4)
    reports = fill.fill_state_blocks_(
        (conv, ssm, no_block_dim), fill.BlockSet([3, 7], 10), FillValue(1.5)
    )
    assert [r.written for r in reports] == [
        Written.ROWS,
        Written.ROWS,
        Written.NO_BLOCK_DIM,
    ]
    pages = pool.view(10, 12)
    assert (pages[[3, 7]] == 1.5).all()
    assert not pages[[0, 1, 2, 4, 5, 6, 8, 9]].any()
    assert not no_block_dim.any()


def test_random_fill_of_rows_larger_than_the_noise_bank_bytes(monkeypatch):
    monkeypatch.setattr(fill, "NOISE_BYTES", 16)  # 8 samples, for rows of 21
    state = torch.zeros(40, 3, 7, dtype=torch.bfloat16)
    ids = list(range(1, 40, 2))
    fill.fill_state_blocks_([state], fill.BlockSet(ids, 40), FillValue(0.0, 1.0))
    assert state[ids].ne(0).all()
    assert not state[list(range(0, 40, 2))].any()


@pytest.mark.parametrize(
    "dtype,encoding",
    [
        (torch.bfloat16, None),
        (torch.float32, None),
        (torch.uint8, torch.float8_e4m3fn),
        (torch.float8_e5m2, None),
    ],
)
def test_random_rows_are_the_banks_rows_in_block_order_repeating(dtype, encoding):
    """The k-th requested row gets the bank's row k mod its length (at least
    NOISE_ROWS), drawn once: a second fill writes the same bytes."""
    cache = torch.zeros(200, 8, 64, dtype=torch.uint8).view(dtype)
    noise = fill.NoiseBank()
    ids = list(range(3, 200, 3))
    value = FillValue(0.5, 0.25, encoding)
    fill.fill_cache_blocks_(cache, fill.BlockSet(ids, 200), value, noise=noise)
    as_bytes = cache.view(torch.uint8)
    value_bytes = FillValue(
        0.5, 0.25, encoding or (dtype if dtype.itemsize == 1 else None)
    )
    bank = noise.rows(as_bytes if dtype.itemsize == 1 else cache, value_bytes)
    count = bank.shape[0]
    assert count >= fill.NOISE_ROWS
    for k, block in enumerate(ids):
        assert torch.equal(as_bytes[block], bank[k % count].view(torch.uint8)), k
    assert not as_bytes[[b for b in range(200) if b not in ids]].any()
    again = torch.zeros_like(as_bytes).view(dtype)
    fill.fill_cache_blocks_(again, fill.BlockSet(ids, 200), value, noise=noise)
    assert torch.equal(again.view(torch.uint8), as_bytes)


def test_the_banks_rows_are_distinct_and_normal_and_fp8_has_no_nan_byte():
    rows = torch.zeros(64, 4096, dtype=torch.uint8)
    value = FillValue(0.0, 1000.0, torch.float8_e4m3fn)  # most samples clamped
    fill.fill_cache_blocks_(rows, fill.BlockSet(range(1, 64), 64), value)
    assert not ((rows & 0x7F) == 0x7F).any()  # e4m3fn's NaN bytes
    bank = fill.NoiseBank()
    floats = torch.zeros(4, 1024)
    samples = bank.rows(floats, FillValue(0.5, 0.25))
    assert samples.shape[0] >= fill.NOISE_ROWS
    assert samples.unique(dim=0).shape[0] == samples.shape[0]
    assert abs(samples.mean().item() - 0.5) < 0.01
    assert abs(samples.std().item() - 0.25) < 0.01


def test_a_pages_write_returns_the_ids_outside_its_pool_and_writes_the_others():
    pages = torch.zeros(12, 2, 64, dtype=torch.bfloat16)  # (blocks, layers, page)
    outside = fill.PagesFill.of(pages, FillValue(0.5)).write_([3, -2, 12, 40, 0])
    assert outside == [-2, 12, 40]
    assert (pages[3] == 0.5).all()
    assert not pages[[0, 1, 2, *range(4, 12)]].any()


def layers_of_one_buffer(layout: str, num_layers=3, num_blocks=12, ratio=1):
    """`num_layers` views ``[B, H, N, C]`` over one byte buffer, as vLLM 0.33's
    allocator places them: "layer-outer" (each layer its own region),
    "block-outer" (each block holds every layer's page) or "heads-inner"
    (layer-outer, tokens and heads permuted within the page)."""
    heads, tokens, content = 2, 8 // ratio, 16
    page = heads * tokens * content * ratio
    raw = torch.randint(
        0, 256, (num_layers * num_blocks * page * 2,), dtype=torch.uint8
    )
    values = raw.view(torch.bfloat16)
    shape = (num_blocks * ratio, heads, tokens, content)
    kernel_page = page // ratio
    views = []
    for layer in range(num_layers):
        if layer_outer := layout != "block-outer":
            offset, block_stride = layer * num_blocks * page, kernel_page
        else:
            offset, block_stride = layer * page, num_layers * page
        inner = (tokens * content, content, 1)
        if layout == "heads-inner":
            inner = (content, heads * content, 1)
        assert layer_outer or ratio == 1
        views.append(torch.as_strided(values, shape, (block_stride, *inner), offset))
    return raw, views


def twin_buffers(layout: str, ratio: int) -> tuple:
    """Two equal buffers of 24 blocks, each with its layers' views: one to
    fill at once, one layer by layer."""
    first, views = layers_of_one_buffer(layout, num_blocks=24, ratio=ratio)
    second, layer_views = layers_of_one_buffer(layout, num_blocks=24, ratio=ratio)
    second.copy_(first)
    return first, views, second, layer_views


def written_as_words(pages, value) -> bool:
    """Whether a constant fill of a group view goes through 16-byte words."""
    return fill.PagesFill.of(pages, value).words is not None


@pytest.mark.parametrize(
    "layout,ratio",
    [("layer-outer", 1), ("layer-outer", 2), ("heads-inner", 1), ("block-outer", 1)],
)
@pytest.mark.parametrize(
    "block_ids",
    [[2, 3, 7, 9, 11], list(range(1, 24, 2))],
    ids=["few runs: a loop", "a run per block: one indexed write"],
)
def test_a_groups_pages_as_one_view_fill_the_same_bytes_as_layer_by_layer(
    layout, ratio, block_ids
):
    blocks = fill.BlockSet(block_ids, 24)
    value = FillValue(0.5)
    by_group, views, by_layer, layer_views = twin_buffers(layout, ratio)
    before = by_group.clone()

    pages = fill.group_pages(views, 24, [ratio] * 3)
    assert pages is not None and pages.shape[:2] == (24, 3)
    assert written_as_words(pages, value)
    report = fill.fill_group_pages_(pages, blocks, value)
    for view in layer_views:
        fill.fill_cache_blocks_(view, blocks, value, 8, None)

    assert report.written is Written.ROWS
    assert torch.equal(by_group, by_layer) and not torch.equal(by_group, before)


@pytest.mark.parametrize(
    "layout,ratio",
    [("layer-outer", 1), ("layer-outer", 2), ("heads-inner", 1), ("block-outer", 1)],
)
def test_a_groups_pages_take_the_random_bytes_that_layer_by_layer_writes(
    layout, ratio, monkeypatch
):
    """At once, the k-th block's page in every layer gets the bank's page k
    mod its length (here 4 pages, so the bank repeats): where a bank's page
    is whole kernel rows, the bytes filling layer by layer from the same
    bank writes, and nothing else."""
    monkeypatch.setattr(fill, "NOISE_ROWS", 2)
    monkeypatch.setattr(fill, "NOISE_BYTES", 4 * 512)  # 4 pages of 512 bytes
    block_ids = [2, 3, 7, 9, 11, *range(13, 24, 2)]
    value, noise = FillValue(0.5, 0.25), fill.NoiseBank()
    by_group, views, by_layer, layer_views = twin_buffers(layout, ratio)
    before = by_group.clone()

    pages = fill.group_pages(views, 24, [ratio] * 3)
    assert pages is not None
    pages_fill = fill.PagesFill.of(pages, value, noise)
    assert pages_fill.samples is not None and pages_fill.samples.rows.shape[0] == 4
    assert pages_fill.write_([*block_ids, 0, 30]) == [30]
    for view in layer_views:
        blocks = fill.BlockSet(block_ids, 24)
        fill.fill_cache_blocks_(view, blocks, value, 8, None, noise)

    assert torch.equal(by_group, by_layer) and not torch.equal(by_group, before)


@pytest.mark.parametrize("layout,block_dim", [("layer-outer", 1), ("block-outer", 0)])
def test_words_are_indexed_in_memory_order(layout, block_dim):
    """The indexed kernel walks the view's dims in order: layers outermost
    where each layer is one region (layer-outer), blocks where each block
    holds every layer (block-outer)."""
    _, views = layers_of_one_buffer(layout, num_blocks=12)
    pages = fill.group_pages(views, 12, [1, 1, 1])
    assert pages is not None
    words = fill.PagesFill.of(pages, FillValue(0.5)).words
    assert words is not None and words.layer_rows is None
    assert list(words.view.stride()) == sorted(words.view.stride(), reverse=True)
    assert words.dim == block_dim and words.view.shape[block_dim] == 12


@pytest.mark.parametrize("layout", ["layer-outer", "block-outer", "heads-inner"])
def test_pages_as_rows_index_every_layers_page_once_in_memory_order(layout):
    """As rows (a GPU's indexing): beyond the index a kernel's offsets span
    one page, and the index lists every layer's page of the blocks once, in
    ascending addresses."""
    _, views = layers_of_one_buffer(layout, num_blocks=12)
    pages = fill.group_pages(views, 12, [1, 1, 1])
    assert pages is not None
    rows = fill.PageWords.of(pages, 0.5, as_rows=True)
    assert rows is not None
    page_words = pages[0, 0].numel() * pages.element_size() // 16
    assert rows.view.shape[1:] == (page_words,) and rows.view.stride(1) == 1

    block_ids = [2, 3, 7, 11]
    starts = [rows.view[row].data_ptr() for row in rows.index_of(block_ids).tolist()]
    pages_of_blocks = [pages[b, layer] for b in block_ids for layer in range(3)]
    assert starts == sorted(page.data_ptr() for page in pages_of_blocks)


@pytest.mark.parametrize(
    "layout,ratio",
    [("layer-outer", 1), ("layer-outer", 2), ("heads-inner", 1), ("block-outer", 1)],
)
@pytest.mark.parametrize("block_ids", [[5], [5, 6, 7], [2, 3, 7, 9, 11]])
def test_pages_written_as_rows_hold_what_layer_by_layer_writes(
    layout, ratio, block_ids
):
    """The rows a GPU writes (from one run on), on the CPU: the same bytes."""
    blocks = fill.BlockSet(block_ids, 24)
    by_rows, views, by_layer, layer_views = twin_buffers(layout, ratio)
    before = by_rows.clone()

    pages = fill.group_pages(views, 24, [ratio] * 3)
    assert pages is not None
    rows = fill.PageWords.of(pages, 0.5, as_rows=True)
    assert rows is not None and rows.min_runs == 1
    rows.fill_(blocks.ids)
    for view in layer_views:
        fill.fill_cache_blocks_(view, blocks, FillValue(0.5), 8, None)

    assert torch.equal(by_rows, by_layer) and not torch.equal(by_rows, before)


@pytest.mark.parametrize(
    "dtype,mean,encoding",
    [
        (torch.bfloat16, 0.015, None),
        (torch.float16, -3.25, None),
        (torch.float32, 1e-30, None),
        (torch.uint8, 0.5, torch.float8_e4m3fn),
        (torch.int8, 0.5, None),
    ],
)
def test_pages_written_as_16_byte_words_hold_the_values_bytes(dtype, mean, encoding):
    raw = torch.randint(0, 256, (24 * 2 * 64,), dtype=torch.uint8)
    pages = raw.view(dtype).view(24, 2, -1)
    before = pages.clone()
    value = FillValue(mean, 0.0, encoding)
    assert written_as_words(pages, value)
    block_ids = list(range(1, 24, 2))
    fill.fill_group_pages_(pages, fill.BlockSet(block_ids, 24), value)

    expected = before.clone()
    expected[block_ids] = (
        0
        if fill._constant_for(dtype, value) is None
        else (fill._constant_for(dtype, value))
    )
    assert torch.equal(pages.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize(
    "block_ids,written",
    [
        ([7, 0, 3, 5, 3, 24, 99, -1, 7], [3, 5, 7]),  # three runs: one indexed write
        ([6, 4, 0, 5, 4, 31], [4, 5, 6]),  # one run: a slice fill
        ([0, 24, -2], []),
    ],
)
def test_a_pages_write_takes_each_valid_id_once_and_nothing_else(block_ids, written):
    """A step hands its ids as gathered: unsorted, repeated across requests,
    the null block, ids past the pool."""
    raw = torch.randint(0, 256, (24 * 2 * 64,), dtype=torch.uint8)
    pages = raw.view(torch.bfloat16).view(24, 2, -1)
    before = pages.clone()
    fill.PagesFill.of(pages, FillValue(0.5)).write_(block_ids)
    expected = before.clone()
    expected[written] = 0.5
    assert torch.equal(pages.view(torch.uint8), expected.view(torch.uint8))


def test_pages_that_are_not_whole_words_are_filled_by_runs():
    raw = torch.randint(0, 256, (24 * 3 * 10,), dtype=torch.uint8)
    pages = raw.view(torch.bfloat16).view(24, 3, 5)  # 10-byte pages
    before = pages.clone()
    assert not written_as_words(pages, FillValue(0.5))
    fill.fill_group_pages_(pages, fill.BlockSet(range(1, 24, 2), 24), FillValue(0.5))
    expected = before.clone()
    expected[1::2] = 0.5
    assert torch.equal(pages.view(torch.uint8), expected.view(torch.uint8))


def test_caches_that_are_not_pages_of_one_buffer_have_no_group_view():
    _, views = layers_of_one_buffer("layer-outer")
    other_dtype = views[0].view(torch.float16)
    assert fill.group_pages([views[0], other_dtype], 12, [1, 1]) is None
    # Offsets not in arithmetic progression: layers 0, 1 and 3 of four.
    _, four = layers_of_one_buffer("layer-outer", num_layers=4)
    assert fill.group_pages([four[0], four[1], four[3]], 12, [1, 1, 1]) is None
    # Kernel rows not next to each other (padding after each kernel block).
    raw = torch.zeros(12 * 2 * 2 * 64 * 2, dtype=torch.bfloat16)
    padded = torch.as_strided(raw, (24, 2, 4, 16), (2 * 4 * 16 * 2, 64, 16, 1))
    assert fill.group_pages([padded], 12, [2]) is None
    # A block dimension that is not dim 0 (FlashAttention's (2, num_blocks, ...)).
    assert fill.group_pages([torch.zeros(2, 12, 4, 16)], 12, [1]) is None


def test_a_group_view_of_float8_pages_is_written_as_their_bytes():
    raw, views = layers_of_one_buffer("layer-outer")
    float8 = [view.view(torch.uint8).view(torch.float8_e4m3fn) for view in views]
    pages = fill.group_pages(float8, 12, [1, 1, 1])
    assert pages is not None
    fill.fill_group_pages_(pages, fill.BlockSet([4], 12), FillValue(0.5))
    written = float8[1][4].float()
    assert (written == 0.5).all()
