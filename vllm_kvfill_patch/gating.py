"""Decide whether the installed vLLM's DecodeBenchConnector needs the patch.

The decision comes from the connector's structure and behaviour alone: a
structure this package does not know is refused rather than guessed at. The
release policy (``releases.SUPPORT_POLICY``) only explains an ``inert``
verdict on a release expected to need the patch (a patched or fixed
connector); it cannot overrule the probes, whose findings every published
release agrees with.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

from vllm_kvfill_patch.releases import APPLIED, DEFECTS, policy_for

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"
FILL_SIGNATURE = ("self", "group_idx", "block_ids", "num_tokens")
STEP_SIGNATURE = ("self", "metadata")
MATCHED_SIGNATURE = ("self", "request", "num_computed_tokens")

FILL = "fill"
"""The worker-side part: fill by block, once per step (``worker_step``)."""
FILL_ONCE = "fill-once"
"""The scheduler-side part: remember a request admitted with nothing to fill
(``fill_once``)."""
PREFIX_HIT = "prefix-hit"
"""The scheduler-side part: fill the blocks after a prefix-cache hit
(``prefix_hit``)."""
OPTIONS = "options"
"""The connector's options checked when it is built, the refill's opt-in
read (``options``)."""
REFILL = "refill"
"""The opt-in scheduler-side part: fill a preempted request again
(``preemption``), for a decode node with an offload tier."""
LINK = "link"
"""The opt-in part on both sides: a request's KV arrives over a modelled
link, through vLLM's async-load path (``link``, ``link_handshake``,
``link_stats``)."""
LINK_METRICS = "link-metrics"
"""Where the link can go in: vLLM's stat loggers read the link's transfers
(``link_stats``), in every process, as the API server's builds no connector
to learn of the link from."""


class Decision(str, enum.Enum):
    PENDING = "pending"
    """The connector module has not been imported in this process yet."""
    APPLIED = "applied"
    INERT = "inert"
    REFUSED = "refused"
    DISABLED = "disabled"
    REVERTED = "reverted"
    """``revert()`` took the patch out; ``apply()`` puts it back."""


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str
    parts: tuple[str, ...] = ()
    """The parts of the patch this connector needs (FILL, FILL_ONCE,
    PREFIX_HIT, OPTIONS)."""
    refill_available: bool = False
    """Whether upstream leaves a preempted request to be recomputed, so
    that the opt-in REFILL part can change that."""
    link_available: bool = False
    """Whether upstream loads synchronously, records its fills where the
    LINK part takes them, and has the worker's ``get_finished`` to report
    them from, so that the opt-in LINK part can go in."""


def judge(module: ModuleType, vllm_version: str | None) -> Verdict:
    """What to do with the loaded connector module of vLLM `vllm_version`."""
    structural = _judge_structure(module)
    policy = policy_for(vllm_version) if vllm_version else None
    if (
        structural.decision is Decision.INERT
        and policy is not None
        and policy.decision == APPLIED
    ):
        return Verdict(
            Decision.INERT,
            f"{structural.reason}, although vLLM {vllm_version} is expected to "
            "need the patch (a patched or fixed connector)",
            refill_available=structural.refill_available,
        )
    return structural


def _judge_structure(module: ModuleType) -> Verdict:
    worker_cls: Any = getattr(module, "DecodeBenchConnectorWorker", None)
    connector_cls = getattr(module, "DecodeBenchConnector", None)
    fill_blocks = getattr(worker_cls, "_fill_blocks", None)
    if fill_blocks is None or not hasattr(connector_cls, "start_load_kv"):
        return Verdict(
            Decision.REFUSED,
            "expected DecodeBenchConnectorWorker._fill_blocks and "
            "DecodeBenchConnector.start_load_kv; found "
            f"worker={worker_cls!r}, _fill_blocks={fill_blocks!r}, "
            f"connector={connector_cls!r}",
        )
    params = tuple(inspect.signature(fill_blocks).parameters)
    if params != FILL_SIGNATURE:
        return Verdict(
            Decision.REFUSED,
            f"expected _fill_blocks{FILL_SIGNATURE}, found _fill_blocks{params}",
        )
    start_fill_kv = getattr(worker_cls, "start_fill_kv", None)
    step_params = (
        tuple(inspect.signature(start_fill_kv).parameters) if start_fill_kv else ()
    )
    if step_params != STEP_SIGNATURE:
        return Verdict(
            Decision.REFUSED,
            f"expected start_fill_kv{STEP_SIGNATURE}, found start_fill_kv{step_params}",
        )
    scheduler_cls = getattr(module, "DecodeBenchConnectorScheduler", None)
    matched = getattr(scheduler_cls, "get_num_new_matched_tokens", None)
    matched_params = tuple(inspect.signature(matched).parameters) if matched else ()
    if matched_params != MATCHED_SIGNATURE:
        return Verdict(
            Decision.REFUSED,
            "expected DecodeBenchConnectorScheduler.get_num_new_matched_tokens"
            f"{MATCHED_SIGNATURE}, found {matched_params}",
        )
    return _judge_by_probes(module, worker_cls)


class _StateProbe(enum.Enum):
    CRASHES = "crashes"
    WHOLE_TENSOR = "whole tensor"
    ROWS_ONLY = "rows only"


def _judge_by_probes(module: ModuleType, worker_cls: type) -> Verdict:
    """Run the original methods on tiny caches and name what they get wrong."""
    try:
        state = _probe_state_fill(worker_cls)
        defects = [
            defect
            for found, defect in (
                (state is _StateProbe.CRASHES, DEFECTS["crashes"]),
                (state is _StateProbe.WHOLE_TENSOR, DEFECTS["whole_states"]),
                (_probe_kernel_split(worker_cls), DEFECTS["kernel_row"]),
                (_probe_step_temporaries(module, worker_cls), DEFECTS["temporaries"]),
            )
            if found
        ]
        scheduler_cls = module.DecodeBenchConnectorScheduler
        refill_available = _probe_refill(scheduler_cls)
        zero_token_fill = _probe_zero_token_fill(scheduler_cls)
        prefix_hit = _probe_prefix_hit(scheduler_cls)
        link_available = _probe_link(module)
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown"
        return Verdict(
            Decision.REFUSED,
            "expected the fill probes to run on the connector's own methods; "
            f"they raised {type(exc).__name__}: {exc}",
        )
    if state is None:
        return Verdict(
            Decision.REFUSED,
            "expected _fill_blocks to crash on, or fill, a list state cache; "
            "it wrote nothing",
        )
    parts = (
        ((FILL,) if defects else ())
        + ((FILL_ONCE,) if zero_token_fill else ())
        + ((PREFIX_HIT,) if prefix_hit else ())
    )
    if not parts:
        return Verdict(
            Decision.INERT,
            "upstream fills only the requested rows, once per step, in place, "
            "each request once, and the blocks after a prefix-cache hit",
            refill_available=refill_available,
        )
    if zero_token_fill:
        defects.append(DEFECTS["zero_token_fill"])
    if prefix_hit:
        defects.append(DEFECTS["hit_blocks"])
    metrics = (LINK_METRICS,) if link_available and _has_stats_api(module) else ()
    return Verdict(
        Decision.APPLIED,
        "; ".join(defects),
        (*parts, OPTIONS, *metrics),
        refill_available,
        link_available,
    )


def _has_stats_api(module: ModuleType) -> bool:
    """Whether vLLM reads a connector's stats into its metrics
    (``build_kv_connector_stats``, ``build_prom_metrics``)."""
    connector_cls = module.DecodeBenchConnector
    return all(
        callable(getattr(connector_cls, name, None))
        for name in ("build_kv_connector_stats", "build_prom_metrics")
    )


def bare_worker(
    worker_cls: type,
    kv_caches: dict,
    group_to_layers: dict[int, list[str]],
    num_blocks: int,
    fill_mean: float,
    fill_std: float = 0.0,
) -> Any:
    """A worker with only what upstream's fill methods read, in every known
    release and in patches/v0.33.0; no vLLM config needed."""
    worker: Any = object.__new__(worker_cls)
    worker.kv_caches = kv_caches
    worker.group_to_layers = group_to_layers
    worker.fill_mean = fill_mean
    worker.fill_std = fill_std
    worker._zero_fill_group_ids = set()  # 0.30+
    worker._fp8_dtypes = {}  # 0.31+
    worker.num_blocks, worker._host_group_ids = num_blocks, set()  # patches/v0.33.0
    worker._raw_buffer_layers = set()  # patches/v0.33.0
    # patches/v0.23.0 (and vLLM <= 0.29): the configs, as far as the fill reads them.
    worker.kv_cache_config = SimpleNamespace(num_blocks=num_blocks, kv_cache_groups=[])
    cache_config = SimpleNamespace(cache_dtype="auto", num_gpu_blocks=num_blocks)
    worker.vllm_config = SimpleNamespace(cache_config=cache_config)
    return worker


def _probe_state_fill(worker_cls: type) -> _StateProbe | None:
    """The original `_fill_blocks` on a tiny list state cache, block 1 only."""
    import torch  # loaded with vLLM by now; importing this package must not

    state = torch.zeros(4, 2)
    worker = bare_worker(worker_cls, {"probe": [state]}, {0: ["probe"]}, 4, 1.0)
    try:
        upstream_function(worker_cls, "_fill_blocks")(worker, 0, [1], 1)
    except AttributeError as exc:
        if "'list' object has no attribute" in str(exc):
            return _StateProbe.CRASHES
        raise
    touched = set(state.ne(0).any(dim=1).nonzero().flatten().tolist())
    if not touched:
        return None
    return _StateProbe.ROWS_ONLY if touched == {1} else _StateProbe.WHOLE_TENSOR


def _probe_kernel_split(worker_cls: type) -> bool:
    """Whether block 1 of a cache split into 2 kernel rows per block misses
    rows 2 and 3 (the model runner's layout when the backend cannot run the
    manager's block size)."""
    import torch

    cache = torch.zeros(8, 2)  # 4 blocks x 2 kernel rows
    worker = bare_worker(worker_cls, {"probe": cache}, {0: ["probe"]}, 4, 1.0)
    upstream_function(worker_cls, "_fill_blocks")(worker, 0, [1], 1)
    return set(cache.ne(0).any(dim=1).nonzero().flatten().tolist()) != {2, 3}


def _probe_step_temporaries(module: ModuleType, worker_cls: type) -> bool:
    """Whether a step of two one-block requests allocates a block-sized
    tensor per request (a region-sized temporary, then a scatter)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    row = (16, 4)
    cache = torch.zeros(8, *row)
    worker = bare_worker(worker_cls, {"probe": cache}, {0: ["probe"]}, 8, 1.0)
    metadata = module.DecodeBenchConnectorMetadata(
        reqs_to_fill={"a": (([1],), 16), "b": (([3],), 16)}
    )
    block_sized = []

    class CountBlockSizedResults(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Tensor) and result.numel() >= cache[0].numel():
                if result.untyped_storage().data_ptr() != cache.data_ptr():
                    block_sized.append(func)
            return result

    start_fill_kv = upstream_function(worker_cls, "start_fill_kv")
    fill_blocks = upstream_function(worker_cls, "_fill_blocks")
    # The step's calls to self._fill_blocks reach upstream's, not an overlay.
    worker._fill_blocks = fill_blocks.__get__(worker)
    with CountBlockSizedResults():
        start_fill_kv(worker, metadata)
    return len(block_sized) >= 2


def _probe_refill(scheduler_cls: type) -> bool:
    """Whether a request the scheduler side filled before is told 0 matched
    tokens when it comes back preempted (so vLLM recomputes it, as a decode
    node does, and the opt-in refill can change that)."""
    scheduler, request = preempted_after_a_fill(scheduler_cls)
    matched = upstream_function(scheduler_cls, "get_num_new_matched_tokens")
    num_tokens, _ = matched(scheduler, request, 0)
    if num_tokens not in (0, 7):
        raise ValueError(f"expected 0 or 7 matched tokens, got {num_tokens}")
    return num_tokens == 0


def _probe_link(module: ModuleType) -> bool:
    """Whether upstream answers a new 8-token request ``(7, False)`` and
    records its fill in ``_pending_fills``, the connector has vLLM's
    ``get_finished`` and ``build_connector_meta``, and vLLM has the state a
    request waits for its KV in."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    connector_cls = module.DecodeBenchConnector
    if not all(
        callable(getattr(connector_cls, name, None))
        for name in ("get_finished", "build_connector_meta")
    ) or not hasattr(RequestStatus, "WAITING_FOR_REMOTE_KVS"):
        return False
    scheduler_cls = module.DecodeBenchConnectorScheduler
    scheduler = bare_scheduler(scheduler_cls)
    request = probe_request(8, RequestStatus.WAITING)
    matched = upstream_function(scheduler_cls, "get_num_new_matched_tokens")
    if matched(scheduler, request, 0) != (7, False):
        return False
    blocks = KVCacheBlocks(([KVCacheBlock(block_id) for block_id in (4, 5, 6, 7)],))
    record = upstream_function(scheduler_cls, "update_state_after_alloc")
    record(scheduler, request, blocks, 7)
    return "probe" in scheduler._pending_fills


def preempted_after_a_fill(scheduler_cls: type) -> tuple[Any, Any]:
    """A bare scheduler side that filled request "probe" (8 tokens), and that
    request come back preempted: 7 tokens to match, or 0 without a refill."""
    from vllm.v1.request import RequestStatus

    scheduler = bare_scheduler(scheduler_cls)
    scheduler._filled_requests.add("probe")
    return scheduler, probe_request(8, RequestStatus.PREEMPTED, num_preemptions=1)


def probe_request(num_tokens: int, status: Any, num_preemptions: int = 0) -> Any:
    """Request "probe", with what the scheduler side's methods read."""
    return SimpleNamespace(
        request_id="probe",
        num_tokens=num_tokens,
        num_computed_tokens=0,
        num_preemptions=num_preemptions,
        status=status,
    )


def _probe_zero_token_fill(scheduler_cls: type) -> bool:
    """Whether a one-token prompt, admitted with nothing to fill, is offered
    its 3 generated tokens when it comes back preempted (#57419)."""
    offered = offered_after_a_zero_token_fill(
        bare_scheduler(scheduler_cls),
        upstream_function(scheduler_cls, "get_num_new_matched_tokens"),
        upstream_function(scheduler_cls, "update_state_after_alloc"),
    )
    if offered not in (0, 3):
        raise ValueError(f"expected 0 or 3 matched tokens, got {offered}")
    return offered == 3


def offered_after_a_zero_token_fill(scheduler: Any, matched: Any, record: Any) -> int:
    """The tokens `matched` (the scheduler side's ``get_num_new_matched_tokens``)
    offers a one-token prompt that `record` (``update_state_after_alloc``)
    admitted with nothing to fill, back after a preemption with 3 generated."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    request = probe_request(1, RequestStatus.WAITING)
    first, _ = matched(scheduler, request, 0)
    if first != 0:
        raise ValueError(f"expected 0 matched tokens for one token, got {first}")
    record(scheduler, request, KVCacheBlocks(([KVCacheBlock(4)],)), 0)
    request.num_tokens, request.num_preemptions = 4, 1
    request.status = RequestStatus.PREEMPTED
    offered, _ = matched(scheduler, request, 0)
    return offered


def bare_scheduler(scheduler_cls: type) -> Any:
    """A scheduler side with only what upstream's scheduling methods read
    (one group of 2-token blocks), in every known release and in patches/."""
    scheduler: Any = object.__new__(scheduler_cls)
    scheduler._filled_requests, scheduler._pending_fills = set(), {}
    scheduler.block_size = 2  # up to 0.29
    scheduler.kv_cache_groups = [SimpleNamespace(kv_cache_spec=None)]  # 0.30+
    scheduler.group_block_sizes, scheduler._startup_fill_group_ids = (2,), set()
    scheduler.startup_fill, scheduler._non_transfer_group_ids = False, set()  # 0.34+
    scheduler.refill_preempted = False  # patches/ (0005: off, as upstream)
    return scheduler


def _probe_prefix_hit(scheduler_cls: type) -> bool:
    """Whether, after a one-block prefix-cache hit, upstream records the hit
    block (the first blocks) rather than the blocks after it."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    scheduler = bare_scheduler(scheduler_cls)
    # 7 tokens: 6 to have computed, 2 of them (block 4) hit, 4 matched.
    request = SimpleNamespace(request_id="probe", num_tokens=7)
    blocks = KVCacheBlocks(([KVCacheBlock(block_id) for block_id in (4, 5, 6, 7)],))
    record = upstream_function(scheduler_cls, "update_state_after_alloc")
    record(scheduler, request, blocks, 4)
    (recorded,), _ = scheduler._pending_fills["probe"]
    if recorded not in ([4, 5], [5, 6]):
        raise ValueError(f"expected blocks [4, 5] or [5, 6], got {recorded}")
    return recorded == [4, 5]


def upstream_function(cls: type, name: str) -> Any:
    """Upstream's function under any wrapper (the probe runs before ours is
    installed, but another package's may be there)."""
    import wrapt

    return wrapt.unwrapped(cls.__dict__[name])
