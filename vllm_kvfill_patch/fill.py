"""Write dummy values into the KV-cache rows of given blocks, in place.

Pure torch: no vLLM, no wrapt, so it can be tested and benchmarked on its own.

Every cache handed to vLLM's connector is block-indexed: an attention tensor
has one row per KV block along its block dimension, and each Mamba / linear
attention state tensor has one row per block along dim 0 (row b is the state
kept in block b). The rows of other blocks belong to other requests, and the
tensors are views over memory pools shared across layers, so only the
requested rows may be written.
"""

from __future__ import annotations

import array
import enum
import functools
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

_CPU = torch.device("cpu")

NULL_BLOCK_ID = 0
"""vLLM's block pool reserves block 0 as the shared null (placeholder) block.
No request owns it, so it is never filled."""

NOISE_ROWS = 16
"""A random fill copies rows of samples drawn once (`NoiseBank`) into the
requested rows: at least this many distinct rows, so that a tensor's filled
rows repeat no more often than every 16 rows."""

NOISE_BYTES = 1024 * 1024
"""...and rows of at least this many bytes in all, where 16 rows are fewer:
a bank is ``max(NOISE_ROWS rows, NOISE_BYTES)`` per dtype and value, the
scratch memory a random fill keeps (a bank of 536 KiB rows: 8.4 MiB)."""

INDEXED_MIN_RUNS = 2
"""From two runs of consecutive blocks on, one indexed kernel
(`index_fill_` / `index_copy_`) fills them, not a loop of slice fills: on a
GPU whatever the rows (the index copy and one fill, never more than the
loop's kernels; a group's pages from one run on, see `PageWords`); on the
CPU for a group's pages as 16-byte words, whose index is worked out once
per step and shared by the layers. This crossover and the ones below are
the step benchmark's (``python -m tools.bench``, docs/benchmark.md), which
prints each way against a memset of the same bytes."""

CPU_INDEXED_MIN_RUNS = 8
"""On the CPU, for a single tensor (its words worked out at each call) or
narrower elements than words, one indexed kernel beats a loop of slice
fills from this many runs on, for small rows..."""

CPU_LOOP_MIN_ROW_BYTES = 32 * 1024
"""...but a loop of slice fills is faster for rows this large: each slice
fill is then a memset of a long run, while an indexed kernel pays per
element; unless the rows are written as 16-byte words (`WORD_BYTES`), whose
per-element cost covers 16 bytes."""

WORD_BYTES = 16
"""The widest element an indexed kernel writes (complex128): constant fills
go through views of such words where rows divide into them."""


@dataclass(frozen=True)
class FillValue:
    """What to write: `mean`, or normal(mean, std) samples when std > 0.

    `encoding` names the dtype whose bytes a uint8 cache holds (vLLM stores
    fp8 KV caches as uint8); the value is written in that encoding. Values
    are clamped to the finite range of the dtype written (as vLLM 0.31+
    does): an out-of-range mean gives the largest finite value, never an
    overflow error, inf or an fp8 NaN.
    """

    mean: float
    std: float = 0.0
    encoding: torch.dtype | None = None


class Written(enum.Enum):
    """Which part of a tensor a fill wrote."""

    ROWS = "rows"
    NOTHING = "nothing"
    NO_BLOCK_DIM = "nothing: no block dimension"


@dataclass(frozen=True)
class FillReport:
    """What one tensor's fill did, for the caller to log."""

    written: Written
    zeroed: bool = False
    """True when the dtype cannot hold the value and zeros were written."""


def sort_block_ids(
    block_ids: Iterable[int], num_blocks: int
) -> tuple[list[int], list[int]]:
    """The ids in `1 .. num_blocks - 1`, sorted, each once; and the ids
    outside the pool, ``0 .. num_blocks - 1`` (bad input: never written, for
    the caller to report). The null block is in neither."""
    ids = sorted(set(block_ids))
    end = bisect_left(ids, num_blocks)
    outside = ids[: bisect_left(ids, 0)] + ids[end:]
    return ids[bisect_right(ids, NULL_BLOCK_ID) : end], outside


def _runs_of(ids: list[int]) -> list[tuple[int, int]]:
    if not ids:
        return []
    if ids[-1] - ids[0] + 1 == len(ids):  # the common case: one allocation run
        return [(ids[0], len(ids))]
    runs = []
    start = previous = ids[0]
    for block_id in ids[1:]:
        if block_id != previous + 1:
            runs.append((start, previous - start + 1))
            start = block_id
        previous = block_id
    runs.append((start, previous - start + 1))
    return runs


def _has_runs(ids: list[int], count: int) -> bool:
    found = 1 if ids else 0
    if found >= count:
        return True
    for previous, block_id in pairwise(ids):
        if block_id != previous + 1:
            found += 1
            if found >= count:
                return True
    return False


class RowRuns:
    """The rows of sorted, distinct `block_ids` where each block is `ratio`
    rows: as `(start, length)` runs for a loop of slice fills, or as an index
    tensor (built at most once per device) for one indexed kernel. Each is
    worked out only when a fill asks for it."""

    def __init__(self, block_ids: list[int], ratio: int = 1) -> None:
        self.block_ids = block_ids
        self.ratio = ratio
        self.num_rows = len(block_ids) * ratio
        self._runs: list[tuple[int, int]] | None = None
        self._has_runs: dict[int, bool] = {}  # asked per tensor of a group
        self._index: dict[torch.device, torch.Tensor] = {}

    @property
    def runs(self) -> list[tuple[int, int]]:
        # Not functools.cached_property: it takes a lock at every call up to
        # Python 3.11, and a step asks per tensor.
        if self._runs is None:
            ratio = self.ratio
            runs = _runs_of(self.block_ids)
            self._runs = [(start * ratio, n * ratio) for start, n in runs]
        return self._runs

    def has_runs(self, count: int) -> bool:
        """Whether the rows make at least `count` runs: counted only as far
        as `count`, since an indexed kernel takes them without their runs."""
        if self._runs is not None:
            return len(self._runs) >= count
        answer = self._has_runs.get(count)
        if answer is None:
            answer = self._has_runs[count] = _has_runs(self.block_ids, count)
        return answer

    def index(self, device: torch.device) -> torch.Tensor:
        index = self._index.get(device)
        if index is None:
            index = self._index[device] = _row_index(self.block_ids, self.ratio, device)
        return index


def _row_index(block_ids: list[int], ratio: int, device: torch.device) -> torch.Tensor:
    """The rows of `block_ids` where each block is `ratio` rows, as an index
    tensor on `device`."""
    index = _host_index(block_ids)
    if ratio != 1:
        index = (index[:, None] * ratio + torch.arange(ratio)).flatten()
    return _to_device(index, device)


def _host_index(block_ids: list[int]) -> torch.Tensor:
    # Through an int64 array: torch.tensor(list) converts element by element.
    ids = array.array("q", block_ids)
    if ids:
        return torch.frombuffer(ids, dtype=torch.long)
    return torch.empty(0, dtype=torch.long)  # frombuffer refuses an empty buffer


def _to_device(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device == _CPU:  # compared first: `device.type` builds a string per call
        return index
    if device.type == "cuda":
        # From pinned memory, non-blocking: a pageable host-to-device copy
        # synchronises the stream, inside the scheduler step.
        return index.pin_memory().to(device, non_blocking=True)
    return index.to(device)


class BlockSet:
    """The valid requested blocks of one KV-cache group, built once and shared
    by every tensor filled with them: a scheduler step's fill builds one per
    group, whatever the number of layers, state tensors and requests.

    Ids outside ``1 .. num_blocks - 1`` are dropped (those outside the pool
    kept in `outside`), duplicates count once.
    """

    def __init__(self, block_ids: Iterable[int], num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ids, self.outside = sort_block_ids(block_ids, num_blocks)
        self._rows: dict[int, RowRuns] = {}

    def rows(self, ratio: int = 1) -> RowRuns:
        """The rows of these blocks where each block is `ratio` rows."""
        if ratio not in self._rows:
            self._rows[ratio] = RowRuns(self.ids, ratio)
        return self._rows[ratio]


@dataclass(frozen=True)
class BlockDim:
    """Where an attention cache keeps its blocks.

    Manager block b is rows ``b * ratio .. b * ratio + ratio - 1`` along
    `dim`: vLLM's model runner splits each KV-manager block into `ratio`
    kernel blocks when the attention backend cannot run the manager's block
    size (``_reshape_kv_cache_tensors``).
    """

    dim: int
    ratio: int = 1


def find_block_dim(
    shape: Sequence[int],
    num_blocks: int,
    block_size: int | None = None,
    states_of: Callable[[int], int] | None = None,
) -> BlockDim | None:
    """The dimension of an attention cache that indexes blocks, or None.

    Blocks live along dim 0, ``(num_blocks * ratio, ...)``, or, for
    FlashAttention up to vLLM 0.22, which stacks K and V first, along dim 1
    of ``(2, num_blocks * ratio, ...)``; dim 0 is tried first. With the
    group's `block_size` (tokens per manager block) a split (ratio > 1) is
    taken only where a later dimension holds the kernel block's
    ``block_size // ratio`` tokens, or, with `states_of` (the spec's states
    per kernel block of so many tokens: compressed caches store one state
    per several tokens), that many states; without it, the first dimension
    whose size is a multiple of `num_blocks` is taken.
    """
    candidates = [0] + ([1] if len(shape) >= 2 and shape[0] == 2 else [])
    for dim in candidates:
        if dim >= len(shape) or num_blocks <= 0 or shape[dim] % num_blocks:
            continue
        ratio = shape[dim] // num_blocks
        if ratio == 0:
            continue
        if ratio == 1 or block_size is None:
            return BlockDim(dim, ratio)
        if block_size % ratio:
            continue
        rows = (
            block_size // ratio if states_of is None else states_of(block_size // ratio)
        )
        if rows in shape[dim + 1 :]:
            return BlockDim(dim, ratio)
    return None


def fill_cache_blocks_(
    cache: torch.Tensor,
    blocks: BlockSet,
    value: FillValue,
    block_size: int | None = None,
    states_of: Callable[[int], int] | None = None,
    noise: NoiseBank | None = None,
) -> FillReport:
    """Fill the rows of `blocks` along an attention cache's block dimension.

    Each block's kernel rows, where the cache is kernel-split. A tensor with
    no block dimension (``find_block_dim``) is left untouched. Random values
    are copied from `noise` (a bank of its own where none is given).
    """
    found = find_block_dim(cache.shape, blocks.num_blocks, block_size, states_of)
    if found is None:
        return FillReport(Written.NO_BLOCK_DIM)
    rows = cache.movedim(found.dim, 0)
    return _fill_runs_(rows, blocks.rows(found.ratio), value, noise)


def group_pages(
    caches: Sequence[torch.Tensor], num_blocks: int, ratios: Sequence[int]
) -> torch.Tensor | None:
    """All `caches`' blocks as one ``(num_blocks, layers, page)`` view, or None.

    vLLM 0.33's allocator places the layers of a group in one backing buffer,
    at a constant layer stride, each block a dense page (its kernel rows next
    to each other where the cache is split `ratio` ways). Then
    ``view[b, l]`` is layer ``l``'s block ``b``, and one fill of the view's
    rows writes every layer of the group: exactly the bytes filling layer by
    layer writes, in one indexed kernel or one kernel per run of blocks
    instead of one per layer. None where the caches are not such
    pages: other dtypes or storages, a block dimension that is not dim 0,
    padded or interleaved kernel rows, offsets not in arithmetic progression.
    """
    if not caches:
        return None
    first = caches[0]
    placements = []
    for cache, ratio in zip(caches, ratios, strict=True):
        if (
            cache.dtype != first.dtype
            or cache.device != first.device
            or cache.dim() < 2
            or cache.shape[0] != num_blocks * ratio
            or cache.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or not _dense(cache[0])
        ):
            return None
        kernel_page = cache[0].numel()
        if ratio > 1 and cache.stride(0) != kernel_page:
            return None
        placements.append(
            (cache.storage_offset(), kernel_page * ratio, cache.stride(0) * ratio)
        )
    placements.sort()
    offsets = [offset for offset, _, _ in placements]
    if len({(page, stride) for _, page, stride in placements}) != 1:
        return None
    _, page, block_stride = placements[0]
    layer_stride = offsets[1] - offsets[0] if len(offsets) > 1 else page
    if layer_stride <= 0 or any(
        later - earlier != layer_stride for earlier, later in pairwise(offsets)
    ):
        return None
    storage = torch.empty(0, dtype=first.dtype, device=first.device)
    storage.set_(first.untyped_storage())
    return torch.as_strided(
        storage,
        (num_blocks, len(offsets), page),
        (block_stride, layer_stride, 1),
        offsets[0],
    )


def _dense(page: torch.Tensor) -> bool:
    """Whether `page`'s elements fill one range of memory, in any dim order
    (0.33's layouts permute heads and tokens within a page)."""
    expected = 1
    shape_and_strides = zip(page.shape, page.stride(), strict=True)
    dims = sorted((stride, size) for size, stride in shape_and_strides if size > 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True, eq=False)
class PagesFill:
    """A fill of a ``group_pages`` view, worked out once (the view and the
    scalar it writes, the view as 16-byte words, or a random fill's samples),
    so that a step only picks its blocks."""

    pages: torch.Tensor
    constant: float | int
    zeroed: bool
    """Zeros are written because the dtype cannot hold the value."""
    words: PageWords | None
    """The pages as words for one indexed kernel, see `PageWords.of`."""
    samples: PageSamples | None = None
    """A random fill's samples, copied instead of the constant."""

    @classmethod
    def of(
        cls, pages: torch.Tensor, value: FillValue, noise: NoiseBank | None = None
    ) -> PagesFill:
        """The fill of `value` (random values from `noise`, a bank of its own
        where none is given)."""
        pages, value = _float8_as_bytes(pages, value)
        constant = _constant_for(pages.dtype, value)
        if constant is not None and value.std > 0:
            samples = PageSamples.of(pages, value, noise or NoiseBank())
            return cls(pages, constant, False, None, samples)
        zeroed = constant is None and bool(value.mean)
        written = 0 if constant is None else constant
        words = PageWords.of(pages, written, as_rows=pages.device != _CPU)
        return cls(pages, written, zeroed, words)

    @property
    def writes(self) -> tuple:
        """What it writes where: fills with equal `writes` write the same
        bytes at the same addresses for the same blocks (vLLM 0.33's groups
        overlay one buffer: groups of one spec share their pages)."""
        pages = self.pages
        return (
            pages.device,
            pages.data_ptr(),
            pages.dtype,
            tuple(pages.shape),
            pages.stride(),
            self.constant,
            None if self.samples is None else self.samples.rows.data_ptr(),
        )

    def write_(self, block_ids: Iterable[int]) -> list[int]:
        """Write the constant (or the samples) into the pages of `block_ids`
        (the valid ones, see `sort_block_ids`): as words by one indexed
        kernel from `PageWords.min_runs` runs on, else as a single tensor.
        Without the `BlockSet` the layer-by-layer fills share: a pages fill
        is one write, and a set's bookkeeping would be a large part of it.
        Returns the ids outside the pages' pool, not written."""
        ids, outside = sort_block_ids(block_ids, self.pages.shape[0])
        if not ids:
            return outside
        if self.samples is not None:
            self.samples.copy_(ids)
        elif self.words is not None and _has_runs(ids, self.words.min_runs):
            self.words.fill_(ids)
        else:
            _fill_constant_runs_(self.pages, RowRuns(ids), self.constant)
        return outside


@dataclass(frozen=True, eq=False)
class PageSamples:
    """A random fill of a ``group_pages`` view: the k-th requested block's
    page, in every layer, gets the bank's page row ``k mod len(bank)``.

    One broadcast ``index_put_`` per bank's length of blocks writes every
    layer of the group, where a fill layer by layer pays a Python call, its
    views and two kernels per layer (most of a small step). Each layer gets
    the same samples for a block, as the layers' own fills copy them (one
    bank per dtype and value); where a bank's page is whole kernel rows, the
    same bytes.
    """

    target: torch.Tensor
    """The pages ``(blocks, layers, page)``, as words where they divide."""
    rows: torch.Tensor
    """The bank's pages ``(rows, 1, page)``, alike, broadcast over layers."""

    @classmethod
    def of(cls, pages: torch.Tensor, value: FillValue, noise: NoiseBank) -> PageSamples:
        bank = noise.rows(pages[:, 0], value)
        target, bank = _as_words(pages, bank)
        return cls(target, bank[:, None])

    def copy_(self, block_ids: list[int]) -> None:
        """Copy the samples into every layer's page of `block_ids` (sorted)."""
        index = _to_device(_host_index(block_ids), self.target.device)
        _copy_bank_rows_(self.target, index, self.rows)


@dataclass(frozen=True, eq=False)
class PageWords:
    """A ``group_pages`` view as 16-byte words, indexed by one kernel, and
    the word that repeats the fill's constant.

    On the CPU, the ``(blocks, layers, page)`` words in memory order (see
    `_as_wide_words`), indexed along the blocks by a step's ids as they are.

    Elsewhere, as rows (`as_rows`): one dimension, a page each, layer l's
    page of block b at row ``b * block_rows + layer_rows[l]``, indexed by
    every layer's row of the ids, in memory order. Beyond the index the
    kernel's offsets then span one page; over (blocks, layers) they span
    every layer's region, gigabytes in a real pool, and CUDA splits a
    kernel whose offsets pass 2 GiB into one kernel per 2 GiB (read in
    PyTorch's source: 8 kernels at 18 GB, 12 at 74 GB; as rows one, and one
    more per 2^31 words written, 32 GiB). From one run of blocks on, too: a
    slice of the pages spans the layers as well. The layers' rows cost the
    CPU a broadcast add per step, which it does not need: its kernels take
    64-bit offsets.
    """

    view: torch.Tensor
    """complex128 words over the pages' memory: ``(rows, page)`` as rows,
    else the pages' dims in memory order."""
    dim: int
    """The dimension the index runs along."""
    word: complex
    min_runs: int
    """From this many runs of blocks on the kernel writes them."""
    layer_rows: torch.Tensor | None = None
    """As rows, each layer's row of block 0, shaped to broadcast against the
    blocks' rows (`blocks_shape`) in memory order: ``(layers, 1)`` where each
    layer is one region, ``(1, layers)`` where each block holds every layer."""
    blocks_shape: tuple[int, int] = (1, -1)
    block_rows: int = 1

    @classmethod
    def of(
        cls, pages: torch.Tensor, constant: float | int, as_rows: bool
    ) -> PageWords | None:
        """None where the pages do not divide into aligned words, the device
        cannot write such a word exactly, or (`as_rows`) the layers' pages
        are not whole rows of one stride."""
        if not as_rows:
            words = _as_wide_words(pages, constant)
            return None if words is None else cls(*words, INDEXED_MIN_RUNS)
        word = _word_for(pages.dtype, constant, pages.device)
        if word is None:
            return None
        try:
            words = pages.view(torch.complex128)
        except RuntimeError:  # the page not contiguous, or not whole words
            return None
        num_blocks, layers, page = words.shape
        block_stride, layer_stride, _ = words.stride()
        row_stride = math.gcd(block_stride, layer_stride)
        if row_stride < page:  # rows would overlap
            return None
        last_row = (
            (num_blocks - 1) * block_stride + (layers - 1) * layer_stride
        ) // row_stride
        layer_rows = torch.arange(layers) * (layer_stride // row_stride)
        layers_outer = layer_stride > block_stride
        return cls(
            words.as_strided((last_row + 1, page), (row_stride, 1)),
            0,
            word,
            1,
            layer_rows.view((-1, 1) if layers_outer else (1, -1)),
            (1, -1) if layers_outer else (-1, 1),
            block_stride // row_stride,
        )

    def fill_(self, block_ids: list[int]) -> None:
        """Write the word into every layer's page of `block_ids` (sorted)."""
        index = _to_device(self.index_of(block_ids), self.view.device)
        self.view.index_fill_(self.dim, index, self.word)

    def index_of(self, block_ids: list[int]) -> torch.Tensor:
        """The index of `block_ids` (sorted) along `dim`, on the CPU."""
        blocks = _host_index(block_ids)
        if self.layer_rows is None:
            return blocks
        if self.block_rows != 1:
            blocks = blocks * self.block_rows
        return (self.layer_rows + blocks.view(self.blocks_shape)).view(-1)


def _as_wide_words(
    rows: torch.Tensor, constant: float | int
) -> tuple[torch.Tensor, int, complex] | None:
    """`rows` as complex128 words with their dims in memory order, the dim
    that holds the rows, and the word whose 16 bytes repeat `constant` in the
    rows' dtype; None where the rows do not divide into aligned words or the
    device cannot write such a word exactly.

    An indexed kernel costs per element: on 16-byte elements it writes
    scattered pages closest to a memset of the bytes, of the ways it can
    (a loop of slice fills, ``index_fill_`` on int64 words; the step
    benchmark prints each). It walks the dims in the view's order: in
    memory order it writes ascending addresses (a group's pages, layer-major
    in layer-outer layouts), which the CPU's prefetchers follow.
    """
    if rows.dim() < 2:
        return None  # rows of one element would merge into words
    word = _word_for(rows.dtype, constant, rows.device)
    if word is None:
        return None
    try:
        words = rows.view(torch.complex128)
    except RuntimeError:  # the last dim not contiguous, or not whole words
        return None
    strides = words.stride()
    if strides[0] == max(strides):  # already so: a permuted view costs
        return words, 0, word
    order = sorted(range(len(strides)), key=strides.__getitem__, reverse=True)
    return words.permute(order), order.index(0), word


def _word_for(
    dtype: torch.dtype, constant: float | int, device: torch.device
) -> complex | None:
    """The complex128 word repeating `constant` as `dtype`, where `device`
    writes it with ``index_fill_`` and the word stores exactly those bytes
    (only moves store it, no arithmetic: checked once per value)."""
    # A cache lookup finds -0.0 where 0.0 was stored (they are equal), but
    # their bytes differ: the sign is part of the key.
    return _signed_word_for(dtype, constant, math.copysign(1, constant), device)


@functools.lru_cache(maxsize=256)
def _signed_word_for(
    dtype: torch.dtype, constant: float | int, sign: float, device: torch.device
) -> complex | None:
    """`_word_for`, cached; `sign` (that of `constant`) is part of the key only."""
    per_word = WORD_BYTES // dtype.itemsize
    if dtype.itemsize * per_word != WORD_BYTES:
        return None
    pattern = torch.full((per_word,), constant, dtype=dtype)
    word = complex(pattern.view(torch.complex128).item())
    stored = torch.tensor([word], dtype=torch.complex128).view(torch.uint8)
    if not torch.equal(stored, pattern.view(torch.uint8)):
        return None
    try:
        # The kernel on this device, on a scratch word: a backend without
        # complex128 (or its index_fill_) says so here, not in a step. No
        # host copy, so no host synchronisation.
        scratch = torch.empty(1, dtype=torch.complex128, device=device)
        where = torch.zeros(1, dtype=torch.long, device=device)
        scratch.index_fill_(0, where, word)
    except (RuntimeError, TypeError):
        return None
    return word


def fill_group_pages_(
    pages: torch.Tensor, blocks: BlockSet, value: FillValue
) -> FillReport:
    """Write a constant into the blocks' pages of a ``group_pages`` view."""
    if not blocks.ids:
        return FillReport(Written.NOTHING)
    pages_fill = PagesFill.of(pages, value)
    pages_fill.write_(blocks.ids)
    return FillReport(Written.ROWS, pages_fill.zeroed)


def fill_state_blocks_(
    states: Sequence[torch.Tensor],
    blocks: BlockSet,
    value: FillValue,
    noise: NoiseBank | None = None,
) -> list[FillReport]:
    """Fill the rows of `block_ids` in each Mamba / linear-attention state.

    A state whose dim 0 is not `num_blocks` has no block rows to pick: it is
    left untouched, as an attention cache without a block dimension is
    (upstream's #45080 fills such a state whole, and every state with it).
    """
    reports = []
    for state in states:
        if state.dim() >= 1 and state.shape[0] == blocks.num_blocks:
            reports.append(_fill_runs_(state, blocks.rows(), value, noise))
        else:
            reports.append(FillReport(Written.NO_BLOCK_DIM))
    return reports


def _fill_runs_(
    rows: torch.Tensor,
    runs: RowRuns,
    value: FillValue,
    noise: NoiseBank | None = None,
) -> FillReport:
    if not runs.block_ids:
        return FillReport(Written.NOTHING)
    rows, value = _float8_as_bytes(rows, value)
    constant = _constant_for(rows.dtype, value)
    if constant is None or value.std == 0:
        _fill_constant_runs_(rows, runs, 0 if constant is None else constant)
    else:
        _fill_random_runs_(rows, runs, value, noise or NoiseBank())
    zeroed = constant is None and bool(value.mean or value.std)
    return FillReport(Written.ROWS, zeroed)


def _float8_as_bytes(
    rows: torch.Tensor, value: FillValue
) -> tuple[torch.Tensor, FillValue]:
    """A float8 tensor as its bytes, and `value` to be written in that float8
    encoding (the same bytes): the indexed kernels, ``index_fill_`` and
    ``index_copy_``, do not take float8 dtypes on every device."""
    if not _is_float8(rows.dtype):
        return rows, value
    return rows.view(torch.uint8), FillValue(value.mean, value.std, rows.dtype)


def writes_zeros(dtype: torch.dtype, value: FillValue) -> bool:
    """Whether a cache of `dtype` gets zeros whatever `value` (an integer
    cache that is not fp8 bytes): a random fill of it is a constant one."""
    return _constant_for(dtype, FillValue(0.0, 0.0, value.encoding)) is None


def _constant_for(dtype: torch.dtype, value: FillValue) -> float | int | None:
    """The scalar to write into a tensor of `dtype`, or None if only zeros fit."""
    if dtype.is_floating_point:
        return _clamped(value.mean, dtype)
    if dtype == torch.uint8 and _is_float8(value.encoding):
        mean = _clamped(value.mean, value.encoding)
        encoded = torch.tensor(mean, dtype=torch.float32).to(value.encoding)
        return int(encoded.view(torch.uint8).item())
    return None


def _clamped(number: float, dtype: torch.dtype) -> float:
    finfo = torch.finfo(dtype)
    return min(max(number, finfo.min), finfo.max)


def _is_float8(dtype: torch.dtype | None) -> bool:
    return dtype is not None and dtype.is_floating_point and dtype.itemsize == 1


def _fill_constant_runs_(
    rows: torch.Tensor, runs: RowRuns, constant: float | int
) -> None:
    """A constant into a single tensor's rows, worked out at each call."""
    words = _as_wide_words(rows, constant) if _indexed(rows, runs, True) else None
    if words is not None:
        view, dim, word = words
        view.index_fill_(dim, runs.index(rows.device), word)
    elif _indexed(rows, runs):
        rows.index_fill_(0, runs.index(rows.device), constant)
    else:
        for start, length in runs.runs:
            rows[start : start + length].fill_(constant)


def _indexed(rows: torch.Tensor, runs: RowRuns, as_words: bool = False) -> bool:
    """Whether one indexed kernel should fill these runs of a single tensor,
    not a loop (`as_words`: the rows written as 16-byte words)."""
    if rows.device.type != "cpu":
        return runs.has_runs(INDEXED_MIN_RUNS)
    if not runs.has_runs(CPU_INDEXED_MIN_RUNS):
        return False
    # An indexed kernel costs per element: on 16-byte words it wins whatever
    # the rows; on narrower elements only for small rows. A row's bytes
    # without building a view of it (a step's hot path).
    row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
    return as_words or row_bytes < CPU_LOOP_MIN_ROW_BYTES


class NoiseBank:
    """Normal(mean, std) samples, drawn once and copied into every block a
    random fill writes: a fill at the speed of a copy, on every device, with
    one code path and a cost that does not depend on the random generator.

    One bank per device, dtype, encoding and value, drawn at its first fill
    (a worker's layout holds its banks: one draw per registration):
    normal(mean, std) samples in float32 (float64 for float64 caches),
    clamped to the finite range of the dtype written, then converted or, for
    fp8, encoded. The k-th requested row of a tensor (in block order; of a
    group's pages written at once, the k-th block's page, `PageSamples`) gets
    the bank's row ``k mod rows``: the rows repeat every `rows` rows (at
    least `NOISE_ROWS`), so blocks are not independent.
    """

    def __init__(self) -> None:
        self._banks: dict[tuple, torch.Tensor] = {}
        self._rows: dict[tuple, torch.Tensor] = {}  # a step asks per tensor

    def rows(self, like: torch.Tensor, value: FillValue) -> torch.Tensor:
        """The bank's rows for the rows of `like` (its dim 0 indexes rows),
        as a contiguous ``(rows, *like.shape[1:])`` tensor of its dtype."""
        key = (like.device, like.dtype, value, like.shape[1:])
        rows = self._rows.get(key)
        if rows is None:
            rows = self._rows[key] = self._bank_rows(like, value)
        return rows

    def _bank_rows(self, like: torch.Tensor, value: FillValue) -> torch.Tensor:
        row_elements = max(1, math.prod(like.shape[1:]))
        row_bytes = row_elements * like.element_size()
        count = max(NOISE_ROWS, -(-NOISE_BYTES // row_bytes))
        key = (like.device, like.dtype, value.encoding, value.mean, value.std)
        bank = self._banks.get(key)
        if bank is None:
            bank = self._banks[key] = _draw(count * row_elements, like, value)
        elif bank.numel() < count * row_elements:
            # Grown, never redrawn: rows already copied stay the bank's rows.
            more = _draw(count * row_elements - bank.numel(), like, value)
            bank = self._banks[key] = torch.cat([bank, more])
            self._rows.clear()  # views of the bank it replaces
        return bank[: count * row_elements].view(count, *like.shape[1:])

    def to(self, device: torch.device) -> NoiseBank:
        """A bank holding the same samples on `device`: there its fills write
        the bytes this bank's write here (a replay, ``tools/gpu_check.py``)."""
        moved = NoiseBank()
        for key, bank in self._banks.items():
            moved._banks[(device,) + key[1:]] = bank.to(device)
        return moved


def _draw(elements: int, like: torch.Tensor, value: FillValue) -> torch.Tensor:
    """`elements` samples of `value` in the dtype of `like` (fp8 bytes in
    `value.encoding`), clamped to its finite range."""
    sample_dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    samples = torch.empty(elements, dtype=sample_dtype, device=like.device)
    samples.normal_(value.mean, value.std)
    if like.dtype == sample_dtype:
        return samples
    return _encode(samples, like.dtype, value)


def _fill_random_runs_(
    rows: torch.Tensor, runs: RowRuns, value: FillValue, noise: NoiseBank
) -> None:
    """Copy the bank's rows into the requested rows, the k-th (in block
    order) from bank row ``k mod len(bank)``: one copy where the rows are one
    run no longer than the bank, else one broadcast ``index_put_`` of the
    whole bank per bank's length of rows, and one for the rest (two kernels
    and the index's copy per tensor, whatever the rows)."""
    flat = _memory_order_rows(rows)
    target = rows if flat is None else flat
    bank = noise.rows(target, value)
    if flat is not None:
        target, bank = _as_words(flat, bank)
    count = bank.shape[0]
    if len(runs.runs) == 1 and runs.num_rows <= count:
        start, length = runs.runs[0]
        target[start : start + length].copy_(bank[:length])
        return
    _copy_bank_rows_(target, runs.index(rows.device), bank)


def _copy_bank_rows_(
    target: torch.Tensor, index: torch.Tensor, bank: torch.Tensor
) -> None:
    """Copy into `target`'s rows `index` (along dim 0) the bank's rows, the
    k-th from row ``k mod len(bank)``: one broadcast ``index_put_`` of the
    whole bank per bank's length of rows, and one for the rest."""
    count = bank.shape[0]
    whole = index.numel() // count * count
    if whole:
        target.index_put_((index[:whole].view(-1, count),), bank)
    if whole < index.numel():
        target.index_put_((index[whole:],), bank[: index.numel() - whole])


def _memory_order_rows(rows: torch.Tensor) -> torch.Tensor | None:
    """`rows` as ``(rows, elements)``, each row's elements in memory order,
    or None where a row is not one dense range of memory. Samples are
    interchangeable, so where in a row each lands does not matter; in memory
    order a row is one contiguous range (0.33's pages permute heads and
    tokens)."""
    if rows.dim() < 2:
        return None
    inner = sorted(range(1, rows.dim()), key=rows.stride().__getitem__, reverse=True)
    try:
        return rows.permute(0, *inner).view(rows.shape[0], -1)
    except RuntimeError:  # a row is not dense: taken as it is
        return None


def _as_words(
    rows: torch.Tensor, bank: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, elements)`` `rows` and their bank as 16-byte words where they
    divide into aligned ones (an indexed kernel costs per element), else as
    they are. Words are moved, never computed: their bytes are kept."""
    try:
        return rows.view(torch.complex128), bank.view(torch.complex128)
    except RuntimeError:  # not whole or aligned words
        return rows, bank


def _encode(
    samples: torch.Tensor, dtype: torch.dtype, value: FillValue
) -> torch.Tensor:
    """`samples` in the cache's `dtype`; for fp8 caches, their encoding's bytes."""
    if dtype == torch.uint8 and _is_float8(value.encoding):
        return _clamp_to_(samples, value.encoding).to(value.encoding).view(dtype)
    return _clamp_to_(samples, dtype).to(dtype)


def _clamp_to_(samples: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Clamp `samples` in place to the finite range of the `dtype` they go to."""
    if dtype != samples.dtype and dtype.is_floating_point:
        finfo = torch.finfo(dtype)
        samples.clamp_(finfo.min, finfo.max)
    return samples
