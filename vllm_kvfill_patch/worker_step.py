"""The fill part (worker side): the connector's step and its cache layout,
documented once here.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnector.start_load_kv`` (the worker's step) is replaced by
    :func:`load_step`, which fills the step's requests by block (:func:`fill_step`)
    instead of calling the worker's ``start_fill_kv``. The worker's own
    methods stay upstream's, so a step is entirely ours or entirely
    upstream's, whenever the patch goes in or out. The cache layout and the
    real KV-cache groups are taken from the connector at the first step
    after each registration, so a patch applied after the caches were
    registered, or again after ``revert()``, fills right.

Why
    DecodeBenchConnector fills the KV cache with dummy values so decode can be
    benchmarked without prefill. On hybrid / linear-attention models (Mamba,
    Qwen3-Next GDN, Kimi-Linear KDA) a layer's cache is a list/tuple of state
    tensors, and ``_fill_blocks`` crashes with ``'list' object has no
    attribute 'device'`` (0.11.1 - 0.23.x). Upstream #45080 (0.24.0) stops the
    crash by filling each state tensor whole, but state tensors are
    block-indexed views over memory pools shared with other layers: the
    whole-tensor fill overwrites every other request's state and attention
    pages and writes a whole pool per Mamba layer per request (through 0.34.x,
    for the platforms that register list states: ``releases.SUPPORT_POLICY``).
    Up to 0.29 every layer is mapped to group 0, so Mamba layers are filled at
    the attention group's block ids, and FlashAttention's ``(2, num_blocks,
    ...)`` cache (<= 0.22) is indexed on dim 0. In every release, kernel-split
    attention caches (the model runner's ``num_blocks * r`` kernel blocks,
    common on hybrid models) get kernel row ``b``, a piece of another block.
    And every release fills request x group x layer, each time with a
    temporary the size of the filled region and a scatter (0.30+: also a
    boolean-mask device sync): at hundreds of requests per scheduler step the
    fill is most of the step (#56473, #57847).

How
    Each layer of the group being filled gets exactly the rows of that group's block
    ids, along the cache's true block dimension (see ``vllm_kvfill_patch.fill``), in
    place with bounded scratch memory. A tensor cache goes to the block-row fill, a
    list/tuple of tensors to the state fill, anything else is skipped with one
    warning per layer; block ids outside a layer's pool are bad input, never
    written, said once per group. The group map comes from
    ``kv_cache_config.kv_cache_groups`` where upstream collapsed it to group 0; the
    block count from ``kv_cache_config.num_blocks``; each group's block size from
    its spec, to cross-check a kernel split. A step fills the union of its requests'
    block ids once per group: the block set and its row index are built once and
    shared by every layer and state tensor of the group, and where the group's
    layers are pages of one buffer at a constant stride (vLLM 0.32+'s allocator) and
    take one value, all of them are written at once through one view
    (``fill.group_pages``), a constant or random samples alike. From the 0.33
    KV-cache config: each layer's pool size (``num_blocks_of``), its spec's states
    per kernel block (compressed caches), and the layers given the raw buffer (no
    block rows: skipped with one warning). A Mamba layer registered as raw byte
    pages padded to the attention page (0.27 - 0.28) is written up to its states'
    bytes, which its spec tells (``cache_of``); from 0.29 the allocator's views hold
    the state bytes alone. Random values are copied from samples drawn once per
    registration (``fill.NoiseBank``). What to write is upstream's decision where
    the release takes it per layer (0.30+, ``fill_value``): zeros for
    circular-buffer groups, the layer's fp8 encoding, clamped to the dtype's finite
    range; ``startup_fill`` and the scheduler side stay upstream's own code.

    A fill asked for while the current CUDA stream is being captured into a
    graph is not issued (``capturing``, one warning): its index copy from
    pinned host memory and its rows would be baked into the graph and
    replayed, with that step's rows, at every later replay. The step is
    otherwise upstream's: the scheduler side has recorded the requests as
    filled, as upstream does, and their blocks keep what they hold.

Upstream
    #25986 (the connector), #45080 (the whole-tensor state fill, 0.24.0),
    #54647 (per-group map, 0.30.0), #54879 (zero-filled circular buffers),
    #56473 (the fill's cost), #57751 (fill only allocated Mamba blocks).
    The same change as ``git format-patch`` series: ``patches/v<release>/``
    (``v0.34.0`` is the upstream PRs for the newest release, one commit each).
    Upstream's gates on them: ``tests/test_upstream.py``.

Versions
    Where ``releases.SUPPORT_POLICY`` says "applied" (docs/releases.md,
    generated from it): 0.11.1 - 0.34.x today. At run time the connector's
    structure and probes of upstream's own methods decide (``gating``), and
    the status reason names the defects found.

Remove when
    Your vLLM's connector fills kernel-split caches and list states by
    block, once per step, in place (patches/v0.34.0 merged): the probes then
    find nothing and the patch stays out by itself (``inert``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.logger import init_logger

from vllm_kvfill_patch.fill import (
    BlockSet,
    FillReport,
    FillValue,
    NoiseBank,
    PagesFill,
    Written,
    fill_cache_blocks_,
    fill_state_blocks_,
    find_block_dim,
    group_pages,
    writes_zeros,
)
from vllm_kvfill_patch.link import padded_state_bytes, take_transfers

logger = init_logger("vllm.kvfill_patch")

LAYOUT_ATTR = "_kvfill_layout"
ARRIVAL_STREAM_ATTR = "_kvfill_arrival_stream"
"""On a worker with CUDA caches: the stream its link arrivals are filled on."""


@dataclass(frozen=True)
class CacheLayout:
    """What the fill needs to know about the worker's KV caches."""

    num_blocks: int | None
    encoding: torch.dtype | None
    """The dtype a uint8 cache's bytes encode (fp8 KV caches), if any."""
    group_to_layers: dict[int, list[str]] = field(default_factory=dict)
    """The layers of each KV-cache group; the real groups where upstream
    maps every layer to group 0 (up to 0.29). The worker's own map is left
    as upstream set it, so upstream's methods see their own state."""
    block_sizes: dict[int, int] = field(default_factory=dict)
    """Tokens per KV-manager block, by group: how a kernel-split attention
    cache's split ratio is cross-checked."""
    kv_caches: dict | None = None
    """The registration the layout was taken from: the worker's ``kv_caches``
    at the time. Registering again replaces that dict, and the layout with it."""
    layer_blocks: dict[str, int] = field(default_factory=dict)
    """Blocks of the pool behind each layer, where it differs from
    `num_blocks` (0.33: a HiSparse host pool, ``num_blocks_of``)."""
    states_of: dict[str, Callable[[int], int]] = field(default_factory=dict)
    """Per layer, the spec's states per kernel block of so many tokens
    (0.33: compressed caches store one state per several tokens)."""
    raw_layers: frozenset[str] = frozenset()
    """Layers registered as the raw backing buffer (0.33 specs without layer
    views, HiSparse): no block rows to fill, for upstream or for us."""
    state_bytes: dict[str, int] = field(default_factory=dict)
    """Per layer of a Mamba spec whose page is padded, the bytes of its
    states at the start of each page (`cache_of`)."""
    pages_fills: PagesFills = field(default_factory=lambda: PagesFills())
    """Per group, how it is filled at once, if it can be."""
    noise: NoiseBank = field(default_factory=NoiseBank)
    """The random fills' samples, drawn once for this registration."""


@dataclass
class PagesFills:
    """Per group, the fill of all its layers' pages at once (None: layer by
    layer), worked out at its first fill, for the caches it was worked out
    for: a cache replaced in the registered dict starts them over."""

    caches: tuple = ()
    by_group: dict[int, PagesFill | None] = field(default_factory=dict)

    def current(self, kv_caches: dict) -> dict[int, PagesFill | None]:
        """The fills still right for `kv_caches` (checked once per step)."""
        caches = tuple(kv_caches.values())
        if len(caches) != len(self.caches) or not all(
            map(operator.is_, caches, self.caches)
        ):
            self.caches, self.by_group = caches, {}
        return self.by_group


def load_step(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> None:
    """Replacement for ``DecodeBenchConnector.start_load_kv``, the worker's
    step (upstream's calls ``connector_worker.start_fill_kv``, which calls
    ``_fill_blocks`` per request and group; neither is patched, so a step
    is all ours or all upstream's, whenever the patch goes in or out)."""
    worker = getattr(connector, "connector_worker", None)
    metadata: Any = getattr(connector, "_connector_metadata", None)
    if (
        worker is None
        or not hasattr(metadata, "reqs_to_fill")
        or getattr(worker, "kv_caches", None) is None  # a step before registration
    ):
        return wrapped(*args, **kwargs)  # upstream's own answer to misuse
    take_transfers(worker, metadata)
    if metadata.reqs_to_fill:
        fill_step(worker, layout_of(connector, worker), metadata.reqs_to_fill)
    return None


def layout_of(connector: Any, worker: Any) -> CacheLayout:
    """The worker's cache layout, worked out at its first fill."""
    layout = current_layout(worker)
    if layout is None:
        layout = layout_from(
            connector._vllm_config.cache_config,
            getattr(connector, "_kv_cache_config", None),
            worker,
        )
        setattr(worker, LAYOUT_ATTR, layout)
        # At the first step, not when the patch is applied: vLLM 0.32+
        # configures its logging only when the engine starts.
        logger.info(
            "vllm-kvfill-patch fills this worker's KV caches by block, once per "
            "step: %d layers in %d KV-cache groups, %s blocks",
            len(worker.kv_caches or {}),
            len(layout.group_to_layers),
            layout.num_blocks,
        )
    return layout


def fill_arrived(connector: Any, worker: Any, requests: dict) -> Any:
    """Fill the requests whose KV has arrived over the link (`link`), as
    `fill_step` does. On a CUDA cache the fill runs on a stream of the
    worker's own, after the work already queued, and the event recorded
    after it is returned, so that the report waits on it and never the host;
    elsewhere it is done on return (None)."""
    layout = layout_of(connector, worker)
    if not _on_cuda(worker.kv_caches):
        fill_step(worker, layout, requests)
        return None
    stream = getattr(worker, ARRIVAL_STREAM_ATTR, None)
    if stream is None:
        stream = torch.cuda.Stream()
        setattr(worker, ARRIVAL_STREAM_ATTR, stream)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fill_step(worker, layout, requests)
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _on_cuda(kv_caches: Any) -> bool:
    first = next(iter((kv_caches or {}).values()), None)
    if isinstance(first, (list, tuple)):
        first = first[0] if first else None
    return bool(getattr(first, "is_cuda", False))


def fill_step(worker: Any, layout: CacheLayout, requests: dict) -> None:
    """Fill a step's requests ``{req_id: (block_ids_per_group, num_tokens)}``.

    One fill per KV-cache group per scheduler step: the union of the group's
    block ids over every request the step admits, each layer and state
    tensor of the group filled once. The same rows as filling request by
    request (ids are sets of rows), at a cost that does not grow with the
    number of requests beyond the rows themselves.
    """
    block_ids_by_group: dict[int, list[int]] = {}
    for block_ids_per_group, _num_tokens in requests.values():
        for group_idx, block_ids in enumerate(block_ids_per_group):
            # Not setdefault(group_idx, []): it builds a new list per request
            # and group, at hundreds of requests a step.
            gathered = block_ids_by_group.get(group_idx)
            if gathered is None:
                block_ids_by_group[group_idx] = list(block_ids)
            else:
                gathered.extend(block_ids)
    fill_groups(worker, layout, block_ids_by_group)
    logger.debug(
        "vllm-kvfill-patch: filled %d requests' blocks in %d groups in one step",
        len(requests),
        len(block_ids_by_group),
    )


def fill_groups(
    worker: Any, layout: CacheLayout, block_ids_by_group: dict[int, list[int]]
) -> None:
    """Fill each group's block ids in every layer of the group, in place.

    Groups whose pages are the same memory and take the same bytes (vLLM
    0.33's groups of one spec overlay one buffer, each owning its own blocks
    of it) are written in one go, with the union of their blocks: only
    consecutive ones, so that the bytes are those of group by group.
    """
    num_blocks = _num_blocks(worker, layout)
    if num_blocks is None:
        return
    if capturing():
        logger.warning_once(
            "vllm-kvfill-patch: a fill was asked for while the current CUDA "
            "stream is capturing a graph; not filling (a graph would replay "
            "this step's rows)"
        )
        return
    fills = layout.pages_fills.current(worker.kv_caches)
    pending: PagesFill | None = None
    pending_ids: list[int] = []
    pending_groups: list[int] = []
    for group_idx, block_ids in block_ids_by_group.items():
        if not block_ids:
            continue
        if group_idx in fills:
            pages_fill = fills[group_idx]
        else:
            pages_fill = fills[group_idx] = _pages_fill(worker, layout, group_idx)
        if pending is not None and pages_fill is not pending:
            _write_pages(pending, pending_ids, pending_groups)
            pending = None
        if pages_fill is None:
            _fill_layer_by_layer(worker, layout, group_idx, block_ids, num_blocks)
        elif pending is None:
            pending, pending_ids = pages_fill, list(block_ids)
            pending_groups = [group_idx]
        else:
            pending_ids.extend(block_ids)
            pending_groups.append(group_idx)
    if pending is not None:
        _write_pages(pending, pending_ids, pending_groups)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph. Asked only where
    CUDA is initialised: no graph can be capturing before, and a CPU build's
    probe raises."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _write_pages(
    pages_fill: PagesFill, block_ids: list[int], groups: list[int]
) -> None:
    outside = pages_fill.write_(block_ids)
    if outside:
        _warn_outside(groups, pages_fill.pages.shape[0])


def _warn_outside(groups: list[int], num_blocks: int) -> None:
    """Block ids past the pool (or negative) are bad input: not written, said
    once per group (groups written together are named together)."""
    named = ", ".join(map(str, groups))
    logger.warning_once(
        "vllm-kvfill-patch: a step asked for block ids outside the pool of %d "
        "blocks (KV-cache group%s %s); not filling those",
        num_blocks,
        "s" if len(groups) > 1 else "",
        named,
    )


def _num_blocks(worker: Any, layout: CacheLayout) -> int | None:
    """The block count of the worker's caches, None where there is nothing
    to fill (said once where the count is unknown)."""
    if not worker.kv_caches:
        return None
    if layout.num_blocks is None:
        logger.warning_once(
            "vllm-kvfill-patch: the KV-cache block count is unknown (no "
            "KV-cache config, cache_config.num_gpu_blocks unset); not filling"
        )
    return layout.num_blocks


def _fill_layer_by_layer(
    worker: Any,
    layout: CacheLayout,
    group_idx: int,
    block_ids: list[int],
    num_blocks: int,
) -> None:
    """Fill `block_ids` in each layer of the group, a pool of `num_blocks`
    blocks unless the layout says otherwise."""
    # One block set per pool size (almost always one per group), shared by
    # every layer of the group.
    block_sets: dict[int, BlockSet] = {}
    block_size = layout.block_sizes.get(group_idx)
    for layer_name in layout.group_to_layers.get(group_idx, []):
        if layer_name in layout.raw_layers:
            logger.warning_once(
                "vllm-kvfill-patch: layer %s is registered as the raw KV-cache "
                "buffer (its spec has no layer views): it has no block rows to "
                "fill; not filling it",
                layer_name,
            )
            continue
        pool_blocks = layout.layer_blocks.get(layer_name, num_blocks)
        if pool_blocks not in block_sets:
            block_sets[pool_blocks] = BlockSet(block_ids, pool_blocks)
            if block_sets[pool_blocks].outside:
                _warn_outside([group_idx], pool_blocks)
        blocks = block_sets[pool_blocks]
        if not blocks.ids:
            continue
        cache = cache_of(worker, layout, layer_name)
        value = fill_value(worker, layout, group_idx, layer_name)
        if isinstance(cache, torch.Tensor):
            states_of = layout.states_of.get(layer_name)
            report = fill_cache_blocks_(
                cache, blocks, value, block_size, states_of, layout.noise
            )
            _log_report(layer_name, report, cache, pool_blocks)
        elif isinstance(cache, (list, tuple)) and all(
            isinstance(state, torch.Tensor) for state in cache
        ):
            reports = fill_state_blocks_(cache, blocks, value, layout.noise)
            for state, report in zip(cache, reports, strict=True):
                _log_report(layer_name, report, state, pool_blocks, state=True)
        else:
            logger.warning_once(
                "vllm-kvfill-patch: layer %s has a KV cache of type %s, not a "
                "tensor or a list/tuple of tensors; not filling it",
                layer_name,
                type(cache).__name__,
            )


def _pages_fill(worker: Any, layout: CacheLayout, group_idx: int) -> PagesFill | None:
    """The fill of every layer of the group at once (one indexed write of
    16-byte words, or one write per run of blocks; random samples by one
    broadcast copy), where its layers are pages of one buffer at a constant
    stride and take the same value; None where not. A group whose pages
    another group writes alike shares that group's fill."""
    layer_names = layout.group_to_layers.get(group_idx, [])
    caches = [cache_of(worker, layout, name) for name in layer_names]
    layer_blocks = {
        layout.layer_blocks.get(name, layout.num_blocks) for name in layer_names
    }
    values = {fill_value(worker, layout, group_idx, name) for name in layer_names}
    if (
        not caches
        or len(layer_blocks) != 1
        or len(values) != 1
        or any(name in layout.raw_layers for name in layer_names)
        or not all(isinstance(cache, torch.Tensor) for cache in caches)
    ):
        return None
    (num_blocks,), (value,) = layer_blocks, values
    if value.std > 0 and writes_zeros(caches[0].dtype, value):
        value = FillValue(value.mean, 0.0, value.encoding)  # zeros all the same
    if num_blocks is None:
        return None
    block_dims = [
        find_block_dim(
            cache.shape,
            num_blocks,
            layout.block_sizes.get(group_idx),
            layout.states_of.get(name),
        )
        for name, cache in zip(layer_names, caches, strict=True)
    ]
    ratios = [
        found.ratio for found in block_dims if found is not None and found.dim == 0
    ]
    if len(ratios) != len(caches):
        return None
    pages = group_pages(caches, num_blocks, ratios)
    if pages is None:
        return None
    pages_fill = PagesFill.of(pages, value, layout.noise)
    if pages_fill.zeroed:
        logger.warning_once(
            "vllm-kvfill-patch: KV-cache group %d has integer caches (%s; %d "
            "layers, %s ... %s) that cannot hold the fill value; writing zeros",
            group_idx,
            caches[0].dtype,
            len(layer_names),
            layer_names[0],
            layer_names[-1],
        )
    for other in layout.pages_fills.by_group.values():
        if other is not None and other.writes == pages_fill.writes:
            return other
    return pages_fill


def fill_value(
    worker: Any, layout: CacheLayout, group_idx: int, layer_name: str
) -> FillValue:
    """What upstream would write into this layer, for the releases that decide
    it themselves (0.30+): zeros for circular-buffer groups (#54879), whose
    pages may pack non-floating metadata; the per-layer fp8 encoding (0.31+),
    which leaves packed uint8 layouts with inline scales unencoded (zeros).
    Older releases: the fill parameters, and the fp8 encoding that
    ``--kv-cache-dtype`` names."""
    if group_idx in getattr(worker, "_zero_fill_group_ids", ()):
        return FillValue(0.0)
    fp8_dtypes = getattr(worker, "_fp8_dtypes", None)
    encoding = layout.encoding if fp8_dtypes is None else fp8_dtypes.get(layer_name)
    return FillValue(worker.fill_mean, worker.fill_std, encoding)


def current_layout(worker: Any) -> CacheLayout | None:
    """The layout taken from the worker's current registration, if any."""
    layout = getattr(worker, LAYOUT_ATTR, None)
    if layout is None or layout.kv_caches is not worker.kv_caches:
        return None
    return layout


def layout_from(cache_config: Any, kv_cache_config: Any, worker: Any) -> CacheLayout:
    """The layout of `worker`'s registered caches, from the KV-cache config,
    else from vLLM's cache config.

    ``kv_cache_config.num_blocks`` is the count the worker allocated these very
    tensors with, so it wins; ``cache_config.num_gpu_blocks`` is the engine's
    copy, unset in a worker spawned before profiling and changed by
    ``num_gpu_blocks_override``.
    """
    num_blocks = getattr(kv_cache_config, "num_blocks", None)
    if num_blocks is None:
        num_blocks = getattr(cache_config, "num_gpu_blocks", None)
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    block_sizes = {
        group_idx: group.kv_cache_spec.block_size
        for group_idx, group in enumerate(groups)
        if isinstance(getattr(group.kv_cache_spec, "block_size", None), int)
    }
    group_to_layers = dict(worker.group_to_layers or {})
    if len(groups) > 1 and set(group_to_layers) <= {0}:
        group_to_layers = {
            group_idx: list(group.layer_names) for group_idx, group in enumerate(groups)
        }
    # Only the layers this worker holds: a pipeline-parallel stage registers
    # its own layers, while the groups (0.30+: upstream's map) name them all.
    group_to_layers = {
        group_idx: [name for name in names if name in worker.kv_caches]
        for group_idx, names in group_to_layers.items()
    }
    layer_specs = {
        name: spec
        for group in groups
        for name, spec in _layer_specs(group.kv_cache_spec, group.layer_names)
    }
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    return CacheLayout(
        num_blocks,
        fp8_encoding(cache_dtype),
        group_to_layers,
        block_sizes,
        worker.kv_caches,
        layer_blocks=_layer_blocks(kv_cache_config),
        states_of={
            name: spec.get_num_kernel_states
            for name, spec in layer_specs.items()
            if hasattr(spec, "get_num_kernel_states")
        },
        state_bytes={
            name: size
            for name, spec in layer_specs.items()
            if (size := padded_state_bytes(spec)) is not None
        },
        raw_layers=frozenset(
            name
            for name, spec in layer_specs.items()
            if getattr(spec, "has_layer_views", True) is False
        ),
    )


def cache_of(worker: Any, layout: CacheLayout, layer_name: str) -> Any:
    """The layer's registered cache, as far as the fill writes it: a Mamba
    layer registered as raw byte pages (0.27 - 0.28: ``(num_blocks, 1, 1,
    page)`` int8, the page padded to the attention page) only up to its
    states' bytes. The padding is never read; from 0.29 the allocator's
    views cover the state bytes alone and are taken as they are."""
    cache = worker.kv_caches.get(layer_name)
    state_bytes = layout.state_bytes.get(layer_name)
    if (
        state_bytes is None
        or not isinstance(cache, torch.Tensor)
        or cache.element_size() != 1
        or cache.dim() < 2
        or math.prod(cache.shape[1:]) <= state_bytes
    ):
        return cache
    try:
        return cache.view(cache.shape[0], -1)[:, :state_bytes]
    except RuntimeError:  # a page that is not one range of bytes: as it is
        return cache


def _layer_specs(group_spec: Any, layer_names: list[str]) -> list[tuple[str, Any]]:
    """Each layer's own spec (0.30+ groups of mixed specs hold one per layer)."""
    per_layer = getattr(group_spec, "kv_cache_specs", None)
    if isinstance(per_layer, dict):
        return [(name, per_layer.get(name, group_spec)) for name in layer_names]
    return [(name, group_spec) for name in layer_names]


def _layer_blocks(kv_cache_config: Any) -> dict[str, int]:
    """The block count of each layer's pool where the config says it differs
    from ``num_blocks`` (0.33's ``num_blocks_of``: a HiSparse host pool)."""
    num_blocks_of = getattr(kv_cache_config, "num_blocks_of", None)
    if num_blocks_of is None:
        return {}
    counts = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        count = num_blocks_of(tensor)
        if count != kv_cache_config.num_blocks:
            counts.update(dict.fromkeys(tensor.layers, count))
    return counts


def fp8_encoding(cache_dtype: str) -> torch.dtype | None:
    """The fp8 format a uint8 cache stores for a ``--kv-cache-dtype`` value,
    decided as vLLM 0.31+'s connector decides it: plain fp8 in the
    platform's own format (ROCm's MI300 stores e4m3fnuz), e5m2 where named;
    None (zeros are written) for the other fp8 kinds, packed with scales
    (``fp8_ds_mla``, per-token-head) or out of tree (``fp8_inc``)."""
    if cache_dtype == "fp8_e5m2":
        return torch.float8_e5m2
    if cache_dtype not in ("fp8", "fp8_e4m3"):
        return None
    from vllm.platforms import current_platform

    platform_fp8 = getattr(current_platform, "fp8_dtype", None)
    return torch.float8_e4m3fn if platform_fp8 is None else platform_fp8()


WRAPPERS = {"DecodeBenchConnector.start_load_kv": load_step}
"""The attributes the patch wraps, by dotted path in the connector module."""


def _log_report(
    layer_name: str,
    report: FillReport,
    tensor: torch.Tensor,
    num_blocks: int,
    state: bool = False,
) -> None:
    if report.written is Written.NO_BLOCK_DIM and state:
        logger.warning_once(
            "vllm-kvfill-patch: a state tensor of layer %s, shape %s, has no "
            "block dimension (expected num_blocks=%d along dim 0); not filling it",
            layer_name,
            tuple(tensor.shape),
            num_blocks,
        )
    elif report.written is Written.NO_BLOCK_DIM:
        logger.warning_once(
            "vllm-kvfill-patch: layer %s has a KV cache of shape %s with no "
            "block dimension (expected num_blocks=%d, or a multiple of it split "
            "into kernel blocks, along dim 0, or dim 1 after a K/V dim of 2); "
            "not filling it",
            layer_name,
            tuple(tensor.shape),
            num_blocks,
        )
    if report.zeroed:
        logger.warning_once(
            "vllm-kvfill-patch: layer %s has an integer cache (%s) that cannot "
            "hold the fill value; wrote zeros",
            layer_name,
            tensor.dtype,
        )
