"""The link part (opt-in, both sides), documented once here: a request's KV
arrives over a modelled link, through vLLM's own async-load path.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnector.get_num_new_matched_tokens`` (:func:`answer_async`),
    ``DecodeBenchConnector.build_connector_meta`` (:func:`send_transfers`),
    ``DecodeBenchConnectorScheduler.request_finished`` (:func:`drop_in_flight`)
    on the scheduler side; ``DecodeBenchConnector.get_finished``
    (:func:`report_arrivals`) and ``get_transfer_results``
    (:func:`report_failed_loads`, 0.32+) or ``get_block_ids_with_load_errors``
    (:func:`report_failed_blocks`), inherited from vLLM's base connector, on
    each worker, which takes the step's transfers in ``worker_step.load_step``.
    The fill itself stays ``worker_step``'s (``fill_arrived``, handed over at
    install time); the handshake and the metrics are ``link_handshake``'s and
    ``link_stats``'s.

Why
    A real decode node (NixlConnector) answers ``(n, True)``: the request
    waits in ``WAITING_FOR_REMOTE_KVS`` with its blocks reserved while its KV
    crosses the link, the node's steps run for the other requests meanwhile,
    and the request is scheduled once every worker has reported the read
    finished (``KVOutputAggregator`` counts one report per worker). Upstream's
    connector answers ``(n, False)``: the KV arrives the moment the request is
    admitted, and is filled inside the admitting step. The emulated node then
    admits requests faster than the real one, and pays a fill in a step where
    the real node pays nothing.

How
    Off unless ``transfer_latency_ms`` or ``transfer_gbps`` is set in the
    connector's ``kv_connector_extra_config``: ``options`` checks them and
    gives the scheduler side a :class:`Link`. A request with tokens to fill is
    then answered asynchronously. Its transfer carries what a NIXL node reads
    for it on each rank: every layer's page of each of its blocks, from the
    KV-cache specs (one link per rank: ranks read in parallel). It joins the
    link a latency after admission and finishes as ``transfer_sharing`` says
    (``link_sharing``): one at a time, first come first served (the
    default), or sharing the bandwidth with the others on the link, a finish
    that moves later sent to the workers again. At each ``schedule()``,
    the fills upstream recorded go on the link and, in the step's metadata,
    to the workers with the time they take; upstream's metadata is left
    nothing to fill. Each worker starts them when vLLM calls its
    ``start_load_kv``, as a NIXL worker starts its reads (before the forward
    pass up to 0.28, after it from 0.29); at the end of every step
    (``get_finished``) it fills the ones that have arrived and reports each
    once, as NIXL's worker reports the reads it finds done. On a GPU the fill runs on
    a stream of its own and is reported once its event is done, never waited
    for on the host. A request aborted in flight is not filled: the next
    step's metadata drops it, and the workers report it, so that vLLM frees
    its blocks. With ``transfer_failure_rate``, the scheduler side draws each
    transfer's failure (seeded by vLLM's ``--seed``) and tells every worker:
    a failed transfer is not filled, and is reported finished and failed in
    one step, so that vLLM's ``kv_load_failure_policy`` recomputes or fails
    its request, as after a failed NIXL read.

Upstream
    The protocol: #17751 (``WAITING_FOR_REMOTE_KVS``, ``finished_recving``),
    #21072 (``KVOutputAggregator``). The connector is synchronous on purpose
    (#25986: "the fill is fast enough that async overhead isn't worth it"):
    the link model stays an option of this package.

Versions
    Every release the patch applies to (0.11.1 - 0.34 today), where the
    probes find upstream answering ``(n, False)``, recording its fills in
    ``_pending_fills`` and a connector with ``get_finished`` (``gating``).
    Where ``startup_fill`` exists (0.32+) the two cannot be combined: a
    startup-filled group has no fill to carry. Up to 0.16, vLLM's scheduler
    finishes async loads of one KV-cache group only (:func:`loads_every_group`
    asks it): there a hybrid model's link options are an error. Up to 0.14
    vLLM frees an aborted request's blocks at once, and the report of its
    dropped transfer leaves its id in the scheduler's set of finished loads.

Remove when
    Upstream's connector models the link: then use its options instead.
"""

from __future__ import annotations

import functools
import math
import random
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

from vllm_kvfill_patch.link_sharing import Queue, Sharing, queue_for

LINK_ATTR = "_kvfill_link"
"""On the connector's scheduler side: its :class:`Link` (absent: no link model)."""
MODEL_ATTR = "_kvfill_link_model"
"""On the connector's worker side: the :class:`LinkModel` its options asked
for (absent: no link model)."""
TRANSFERS_ATTR = "_kvfill_transfers"
"""On a step's connector metadata: the transfers the step started, by
request id (:class:`Transfer`)."""
DROPPED_ATTR = "_kvfill_dropped"
"""On a step's connector metadata: the ids of transfers aborted in flight."""
RETIMED_ATTR = "_kvfill_retimed"
"""On a step's connector metadata: transfers in flight whose finish moved
(fair sharing), by id: the seconds until they arrive now."""
ARRIVALS_ATTR = "_kvfill_arrivals"
"""On a worker: its transfers in flight and its fills not reported yet
(:class:`Arrivals`)."""

Fill = tuple[tuple[list[int], ...], int]
"""Upstream's recorded fill: the block ids of each group, and the tokens."""
FillArrived = Callable[[Any, Any, dict[str, Fill]], Any]
"""``worker_step.fill_arrived``: fills a worker's arrived requests; returns
the event their fill recorded (None: done). Handed over at install time."""


@dataclass(frozen=True)
class LinkModel:
    """The link a request's KV crosses: a latency, a bandwidth per rank, and
    the fraction of transfers that fail (drawn from `seed`)."""

    latency_ms: float = 0.0
    gbps: float | None = None
    """Gigabits per second, per rank; None: no bandwidth limit."""
    failure_rate: float = 0.0
    seed: int = 0
    sharing: Sharing = Sharing.FIFO

    def bytes_per_second(self) -> float | None:
        return None if self.gbps is None else self.gbps * 1e9 / 8

    def __str__(self) -> str:
        if self.gbps is None:
            said = f"latency {self.latency_ms:g} ms, no bandwidth limit"
        else:
            said = (
                f"latency {self.latency_ms:g} ms, {self.gbps:g} Gb/s per rank, "
                f"{self.sharing}"
            )
        if self.failure_rate:
            said += f", {self.failure_rate:g} of transfers failing (seed {self.seed})"
        return said


@dataclass(frozen=True)
class Transfer:
    """A request's transfer as the scheduler side started it, in the step's
    metadata to every worker: the fill, the seconds until it arrives, the
    bytes it carries on each rank, and whether it fails (then nothing is
    written, and every worker reports it as a failed load)."""

    fill: Fill
    seconds: float
    nbytes: int = 0
    failed: bool = False


@dataclass(frozen=True)
class Reads:
    """What a NIXL decode node reads of a request where upstream's fill
    stops: upstream fills all tokens but the last; NIXL reads all but the
    last ``backoff`` (``_prefill_backoff()``: 1 with Mamba or MTP, else 0).
    Per KV-cache group, its block size where its blocks follow the tokens
    (None: a state group, one block whatever the length)."""

    block_sizes: tuple[int | None, ...] = ()
    backoff: int = 1

    def extra_blocks(self, num_tokens: int) -> tuple[int, ...]:
        """Per group, the blocks NIXL reads for a request of `num_tokens`
        tokens beyond those upstream fills (-1, 0 or 1)."""
        return tuple(
            0
            if size is None
            else -(-(num_tokens - self.backoff) // size) - -(-(num_tokens - 1) // size)
            for size in self.block_sizes
        )

    @classmethod
    def of(cls, kv_cache_config: Any, vllm_config: Any) -> Reads:
        """From the scheduler side's configs: a group of Mamba states (its
        spec has ``shapes``) or a circular buffer holds no block per token,
        and a Mamba group makes NIXL leave the last token to decode."""
        sizes: list[int | None] = []
        for group in kv_cache_config.kv_cache_groups:
            spec = group.kv_cache_spec
            layers = list(getattr(spec, "kv_cache_specs", {}).values()) or [spec]
            per_token = not any(
                hasattr(layer, "shapes") or type(layer).__name__ == "CircularBufferSpec"
                for layer in layers
            )
            sizes.append(spec.block_size if per_token else None)
        has_states = any(size is None for size in sizes)
        lookahead = getattr(vllm_config, "num_prefill_lookahead_tokens", 1)
        backoff = max(1 if has_states else 0, int(lookahead) - 1)
        return cls(tuple(sizes), backoff)


@dataclass
class Link:
    """The scheduler side's link: when each transfer it starts will arrive,
    and which are still in flight as far as the scheduler knows."""

    model: LinkModel
    bytes_per_block: tuple[int, ...]
    """Per KV-cache group: one block's bytes on one rank, every layer of it."""
    clock: Callable[[], float] = time.monotonic
    queue: Queue = field(init=False)
    """When each transfer finishes (``link_sharing``)."""
    retimed: dict[str, float] = field(default_factory=dict)
    """Transfers in flight whose finish moved (fair sharing), by id: when
    they finish now, for the workers."""
    in_flight: set[str] = field(default_factory=set)
    """Started, and not scheduled yet (the workers may still hold them)."""
    dropped: list[str] = field(default_factory=list)
    """Transfers aborted in flight, for the workers to report without a fill."""
    draws: random.Random = field(init=False)
    """Which transfers fail: one draw per transfer, in the order admitted."""
    reads: Reads = field(default_factory=Reads)
    num_tokens: dict[str, int] = field(default_factory=dict)
    """The tokens of each request answered asynchronously, until admitted."""

    def __post_init__(self) -> None:
        self.draws = random.Random(self.model.seed)
        self.queue = queue_for(self.model.sharing, self.model.bytes_per_second())

    @classmethod
    def of(cls, model: LinkModel, kv_cache_config: Any, vllm_config: Any) -> Link:
        """The scheduler side's link for these configs: each group's bytes
        per block, and what NIXL reads of a request."""
        return cls(
            model,
            bytes_per_block(kv_cache_config),
            reads=Reads.of(kv_cache_config, vllm_config),
        )

    def admit(self, fills: Mapping[str, Fill]) -> dict[str, Transfer]:
        """Start a transfer for each fill, in order, on the one link; the
        finish of those in flight that moved is kept for :meth:`take_retimed`."""
        now = self.clock()
        joins_at = now + self.model.latency_ms / 1e3
        nbytes = {
            rid: self.bytes_of(fill[0], self.extra_blocks(rid))
            for rid, fill in fills.items()
        }
        finish = self.queue.start([(rid, joins_at, nbytes[rid]) for rid in fills])
        started = {}
        for request_id, fill in fills.items():
            failed = (
                self.model.failure_rate > 0
                and self.draws.random() < self.model.failure_rate
            )
            seconds = finish[request_id] - now
            started[request_id] = Transfer(fill, seconds, nbytes[request_id], failed)
            self.in_flight.add(request_id)
        earlier = self.in_flight.difference(fills)
        self.retimed.update((rid, at) for rid, at in finish.items() if rid in earlier)
        return started

    def take_retimed(self) -> dict[str, float]:
        """The transfers in flight whose finish moved since the last call: the
        seconds from now until they finish."""
        now = self.clock()
        retimed = {
            rid: at - now for rid, at in self.retimed.items() if rid in self.in_flight
        }
        self.retimed = {}
        return retimed

    def extra_blocks(self, request_id: str) -> tuple[int, ...]:
        num_tokens = self.num_tokens.pop(request_id, None)
        return () if num_tokens is None else self.reads.extra_blocks(num_tokens)

    def bytes_of(
        self, block_ids_per_group: tuple[list[int], ...], extra: tuple[int, ...] = ()
    ) -> int:
        """What NIXL reads of these blocks, and of `extra` more per group."""
        # Not strict: a latency alone has no bytes per block (an old vLLM).
        extra = (*extra, *(0,) * len(self.bytes_per_block))
        groups = zip(block_ids_per_group, self.bytes_per_block, extra, strict=False)
        return sum((len(ids) + more) * nbytes for ids, nbytes, more in groups)

    def scheduled(self, request_ids: Iterable[str]) -> None:
        """Requests scheduled: their transfers arrived, every rank reported."""
        self.in_flight.difference_update(request_ids)

    def drop(self, request_id: str) -> None:
        """A request finished (aborted) while its transfer is in flight."""
        if request_id in self.in_flight:
            self.in_flight.discard(request_id)
            self.dropped.append(request_id)

    def take_dropped(self) -> tuple[str, ...]:
        dropped, self.dropped = self.dropped, []
        return tuple(dropped)


def bytes_per_block(kv_cache_config: Any) -> tuple[int, ...]:
    """Per KV-cache group, what a NIXL decode node reads of one block of
    every layer in it, on one rank: the page, or a state layer's states
    without the padding that aligns its page to the attention page."""

    def layer_bytes(spec: Any) -> int:
        return padded_state_bytes(spec) or spec.page_size_bytes

    sizes = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        sizes.append(
            sum(layer_bytes(per_layer[name]) for name in group.layer_names)
            if isinstance(per_layer, dict)
            else layer_bytes(spec) * len(group.layer_names)
        )
    return tuple(sizes)


def padded_state_bytes(spec: Any) -> int | None:
    """The bytes of a Mamba spec's states where its page is padded to a
    larger size (to the attention page, so that groups share pages), else
    None."""
    shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
    padded = getattr(spec, "page_size_padded", None)
    if not (shapes and dtypes and isinstance(padded, int)):
        return None
    states = sum(
        math.prod(shape) * dtype.itemsize
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    return states if states < padded else None


def loads_every_group() -> bool:
    """Whether vLLM's scheduler can finish an async load of a request with
    blocks in several KV-cache groups. Up to 0.16 its
    ``_update_waiting_for_remote_kv`` unpacks one group's block ids and
    raises "too many values to unpack"; later ones take the request's
    computed tokens. Asked of upstream's own method, on a bare scheduler."""
    from vllm.v1.core.sched.scheduler import Scheduler

    probe: Any = object.__new__(Scheduler)
    probe.connector = object()
    probe.finished_recving_kv_req_ids = {"probe"}
    probe.failed_recving_kv_req_ids = set()
    probe.block_size = 2
    probe.kv_cache_manager = SimpleNamespace(
        get_block_ids=lambda request_id: ([1], [2]),
        cache_blocks=lambda request, num_tokens: None,
    )
    request = SimpleNamespace(request_id="probe", num_tokens=8, num_computed_tokens=7)
    try:
        Scheduler._update_waiting_for_remote_kv(probe, request)
    except ValueError as exc:
        return "unpack" not in str(exc)
    except Exception:  # noqa: BLE001 - a later scheduler reads more of itself
        return True
    return True


def link_of(scheduler: Any) -> Link | None:
    return getattr(scheduler, LINK_ATTR, None)


def answer_async(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnector.get_num_new_matched_tokens``."""
    matched, load_async = wrapped(*args, **kwargs)
    link = link_of(connector.connector_scheduler)
    if not matched or link is None:
        return matched, load_async
    request = _request_argument(*args, **kwargs)
    link.num_tokens[request.request_id] = request.num_tokens
    return matched, True


def send_transfers(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnector.build_connector_meta``: the fills
    recorded this step go on the link, and to the workers as transfers with
    the time they take; upstream's metadata is left nothing to fill now."""
    scheduler = connector.connector_scheduler
    link = link_of(scheduler)
    if link is None:
        return wrapped(*args, **kwargs)
    link.scheduled(_scheduler_output_argument(*args, **kwargs).num_scheduled_tokens)
    transfers = link.admit(scheduler._pending_fills)
    scheduler._pending_fills.clear()
    metadata = wrapped(*args, **kwargs)
    setattr(metadata, TRANSFERS_ATTR, transfers)
    setattr(metadata, DROPPED_ATTR, link.take_dropped())
    setattr(metadata, RETIMED_ATTR, link.take_retimed())
    return metadata


def drop_in_flight(wrapped: Any, scheduler: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnectorScheduler.request_finished``."""
    link = link_of(scheduler)
    if link is not None:
        link.drop(_request_argument(*args, **kwargs).request_id)
    return wrapped(*args, **kwargs)


@dataclass(frozen=True)
class InFlight:
    """A transfer on a worker: when the worker took it, and when it arrives,
    by the worker's clock."""

    transfer: Transfer
    taken_at: float
    arrives_at: float


@dataclass(frozen=True)
class Reported:
    """A transfer a worker reported finished, for vLLM's connector stats."""

    nbytes: int
    seconds: float
    """From the step that admitted it to its report."""
    failed: bool


@dataclass(eq=False)  # by identity: kept in a WeakSet
class Arrivals:
    """A worker's transfers: in flight, arrived and not reported yet (with
    the event their fill recorded; None: done), and what it reported since
    vLLM last asked (the failed loads, and each transfer for the stats)."""

    clock: Callable[[], float] = time.monotonic
    in_flight: dict[str, InFlight] = field(default_factory=dict)
    unreported: list[tuple[dict[str, InFlight | None], Any]] = field(
        default_factory=list
    )
    """Arrived transfers by id (None: dropped in flight), and their fill's event."""
    failed: dict[str, Transfer] = field(default_factory=dict)
    """Reported finished, failed, and not yet told to vLLM as failed."""
    reported: list[Reported] = field(default_factory=list)
    seen: Any = None
    """The metadata whose transfers were taken last: each step's, once."""

    def take(self, metadata: Any) -> None:
        """The step's transfers, started now on this worker as a NIXL read
        is when its worker gets the step; the dropped ones reported unfilled."""
        if metadata is None or metadata is self.seen:
            return
        self.seen = metadata
        now = self.clock()
        transfers: dict[str, Transfer] = getattr(metadata, TRANSFERS_ATTR, {})
        for request_id, transfer in transfers.items():
            self.in_flight[request_id] = InFlight(transfer, now, now + transfer.seconds)
        for request_id, seconds in getattr(metadata, RETIMED_ATTR, {}).items():
            if (held := self.in_flight.get(request_id)) is not None:
                self.in_flight[request_id] = replace(held, arrives_at=now + seconds)
        for request_id in getattr(metadata, DROPPED_ATTR, ()):
            if self.in_flight.pop(request_id, None) is not None:
                self.unreported.append(({request_id: None}, None))

    def arrived(self) -> dict[str, InFlight]:
        """The transfers that have arrived by now, taken out."""
        now = self.clock()
        done = [rid for rid, held in self.in_flight.items() if held.arrives_at <= now]
        return {rid: self.in_flight.pop(rid) for rid in done}

    def ready(self) -> set[str]:
        """The ids whose fills are done, taken out; a failed one kept for
        :meth:`take_failed`, and each one for :meth:`take_reported`."""
        done: set[str] = set()
        waiting = []
        now = self.clock()
        for held, event in self.unreported:
            if event is not None and not event.query():
                waiting.append((held, event))
                continue
            done.update(held)
            for request_id, transfer in held.items():
                if transfer is None:  # dropped in flight: no load to count
                    continue
                if transfer.transfer.failed:
                    self.failed[request_id] = transfer.transfer
                self.reported.append(
                    Reported(
                        transfer.transfer.nbytes,
                        now - transfer.taken_at,
                        transfer.transfer.failed,
                    )
                )
        self.unreported = waiting
        return done

    def take_failed(self) -> dict[str, Transfer]:
        """The failed transfers reported since the last call."""
        failed, self.failed = self.failed, {}
        return failed

    def take_reported(self) -> list[Reported]:
        reported, self.reported = self.reported, []
        return reported


def arrivals_of(worker: Any) -> Arrivals:
    arrivals = getattr(worker, ARRIVALS_ATTR, None)
    if arrivals is None:
        arrivals = Arrivals()
        setattr(worker, ARRIVALS_ATTR, arrivals)
        _arrivals.add(arrivals)
    return arrivals


_arrivals: weakref.WeakSet[Arrivals] = weakref.WeakSet()
"""Every worker's arrivals in this process, while the worker lives."""
WORKER_REPORTS = frozenset(
    (
        "get_finished",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
    )
)
"""The worker's methods the link reports through: kept by ``revert()``
while :func:`unreported` is not 0, so that no transfer is stranded."""


def unreported() -> int:
    """The transfers this process's workers took and have not reported."""
    return sum(
        len(arrivals.in_flight) + sum(len(held) for held, _ in arrivals.unreported)
        for arrivals in list(_arrivals)
    )


def take_transfers(worker: Any, metadata: Any) -> None:
    """At the start of the worker's step (``worker_step.load_step``): the
    transfers the scheduler started this step begin on this worker."""
    if hasattr(metadata, TRANSFERS_ATTR):
        arrivals_of(worker).take(metadata)


def report_arrivals(
    fill_arrived: FillArrived, wrapped: Any, connector: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnector.get_finished``, at the end of each
    step: the transfers that have arrived are filled by `fill_arrived` (the
    failed ones are not), and each is reported once its fill is done, as
    NIXL's worker reports a read it finds done."""
    sending, recving = wrapped(*args, **kwargs)
    worker = getattr(connector, "connector_worker", None)
    if worker is None:
        return sending, recving
    arrivals = arrivals_of(worker)
    arrivals.take(getattr(connector, "_connector_metadata", None))
    if arrived := arrivals.arrived():
        delivered = {
            rid: held.transfer.fill
            for rid, held in arrived.items()
            if not held.transfer.failed
        }
        event = fill_arrived(connector, worker, delivered) if delivered else None
        arrivals.unreported.append((dict(arrived), event))
    if ready := arrivals.ready():
        recving = set(recving or ()) | ready
    return sending, recving


def report_failed_loads(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnector.get_transfer_results`` (vLLM 0.32+):
    a failed transfer is a failed load of its request, in the results that
    report it finished, so that vLLM's ``kv_load_failure_policy`` decides."""
    results = wrapped(*args, **kwargs)
    worker = getattr(connector, "connector_worker", None)
    if worker is not None and (failed := arrivals_of(worker).take_failed()):
        results.failed_recving = set(results.failed_recving) | set(failed)
    return results


def report_failed_blocks(
    wrapped: Any, connector: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnector.get_block_ids_with_load_errors``
    where vLLM has no failed loads by request (up to 0.31): the blocks of a
    failed transfer, asked for after ``get_finished`` in the same step."""
    block_ids = wrapped(*args, **kwargs)
    worker = getattr(connector, "connector_worker", None)
    if worker is None or not (failed := arrivals_of(worker).take_failed()):
        return block_ids
    return set(block_ids or ()) | {
        block_id
        for transfer in failed.values()
        for group in transfer.fill[0]
        for block_id in group
    }


def _scheduler_output_argument(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
    return scheduler_output


def _request_argument(request: Any, *args: Any, **kwargs: Any) -> Any:
    return request


def wrappers(connector_cls: type, fill_arrived: FillArrived) -> dict[str, Any]:
    """The attributes this part wraps, by dotted path in the connector
    module; a failed load is reported by request where vLLM takes it so
    (``get_transfer_results``, 0.32+), else by its blocks."""
    failures = (
        ("get_transfer_results", report_failed_loads)
        if hasattr(connector_cls, "get_transfer_results")
        else ("get_block_ids_with_load_errors", report_failed_blocks)
    )
    return {
        "DecodeBenchConnector.get_num_new_matched_tokens": answer_async,
        "DecodeBenchConnector.build_connector_meta": send_transfers,
        "DecodeBenchConnectorScheduler.request_finished": drop_in_flight,
        "DecodeBenchConnector.get_finished": functools.partial(
            report_arrivals, fill_arrived
        ),
        f"DecodeBenchConnector.{failures[0]}": failures[1],
    }
