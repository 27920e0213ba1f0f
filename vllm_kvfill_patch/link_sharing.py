"""How the link's transfers share a rank's bandwidth (part of the opt-in
``link``): when each finishes. Pure Python, on the scheduler side.

``fifo`` (the default): one transfer at a time, first come first served, as
Splitwise-sim's link queues flows. ``fair``: the transfers on the link share
its bandwidth equally, recomputed as each starts and finishes (processor
sharing, as Dynamo's KVBM offload model shares it as flows come and go), as
NIXL overlaps the reads of a wave.

A transfer joins the link when its latency is over; its finish time is
known at once under ``fifo``, and under ``fair`` moves later each time a
transfer joins before it is done: :meth:`FairShare.start` returns the new
finish of every transfer it moved.
"""

from __future__ import annotations

import enum
import heapq
import math
from dataclasses import dataclass, field
from typing import Protocol

Join = tuple[str, float, int]
"""A transfer: its id, when it joins the link, its bytes."""
DONE_BYTES = 1e-3
"""Bytes left below which a transfer is done (float rounding)."""


class Sharing(str, enum.Enum):
    """The ``transfer_sharing`` option."""

    FIFO = "fifo"
    FAIR = "fair"

    def __str__(self) -> str:
        if self is Sharing.FIFO:
            return "first come first served"
        return "shared fairly among the transfers on it"


class Queue(Protocol):
    def start(self, joins: list[Join]) -> dict[str, float]:
        """Start `joins`, in order: the finish time of each, and of each
        earlier transfer whose finish moved."""


def queue_for(sharing: Sharing, bytes_per_second: float | None) -> Queue:
    if bytes_per_second is None or sharing is Sharing.FIFO:
        return FirstComeFirstServed(bytes_per_second)
    return FairShare(bytes_per_second)


@dataclass
class FirstComeFirstServed:
    """One transfer at a time; None: no bandwidth limit."""

    bytes_per_second: float | None
    free_at: float = -math.inf

    def start(self, joins: list[Join]) -> dict[str, float]:
        finish = {}
        for request_id, join_at, nbytes in joins:
            seconds = nbytes / self.bytes_per_second if self.bytes_per_second else 0.0
            self.free_at = max(join_at, self.free_at) + seconds
            finish[request_id] = self.free_at
        return finish


@dataclass
class FairShare:
    """Processor sharing, by virtual work: every transfer on the link moves
    ``bytes_per_second / n`` a second while `n` are on it, so one that joins
    at virtual work `W` with `b` bytes is done when the work reaches
    ``W + b``; they finish in the order of those tags."""

    bytes_per_second: float
    now: float = -math.inf
    work: float = 0.0
    """Bytes each transfer on the link has moved since the first joined."""
    on_link: list[tuple[float, str]] = field(default_factory=list)
    """Heap of (the work at which it is done, id)."""
    waiting: list[Join] = field(default_factory=list)
    """Transfers still in their latency, by when they join."""
    finish: dict[str, float] = field(default_factory=dict)
    """The finish last said of each transfer not done yet."""

    def start(self, joins: list[Join]) -> dict[str, float]:
        if joins:
            self._run(min(join_at for _, join_at, _ in joins), {})
        self.waiting = sorted([*self.waiting, *joins], key=lambda join: join[1])
        projected = FairShare(
            self.bytes_per_second,
            self.now,
            self.work,
            list(self.on_link),
            list(self.waiting),
        )
        finishes: dict[str, float] = {}
        projected._run(math.inf, finishes)
        moved = {
            rid: at
            for rid, at in finishes.items()
            if abs(at - self.finish.get(rid, math.inf)) > 1e-9
        }
        self.finish.update(moved)
        return moved

    def _run(self, until: float, finishes: dict[str, float]) -> None:
        """The link from `now` to `until`, joins taken at their time; each
        transfer done meanwhile in `finishes`."""
        while self.on_link or self.waiting:
            rate = self.bytes_per_second / len(self.on_link) if self.on_link else 0.0
            done_at = (
                max(self.now, self.now + (self.on_link[0][0] - self.work) / rate)
                if self.on_link
                else math.inf
            )
            join_at = self.waiting[0][1] if self.waiting else math.inf
            at = min(done_at, join_at)
            if at > until:
                break
            self._move_to(at)
            while self.on_link and self.on_link[0][0] <= self.work + DONE_BYTES:
                _, request_id = heapq.heappop(self.on_link)
                finishes[request_id] = at
                self.finish.pop(request_id, None)
            while self.waiting and self.waiting[0][1] <= at:
                request_id, _, nbytes = self.waiting.pop(0)
                heapq.heappush(self.on_link, (self.work + nbytes, request_id))
        if until > self.now and not math.isinf(until):
            self._move_to(until)

    def _move_to(self, at: float) -> None:
        if self.on_link:
            self.work += (at - self.now) * self.bytes_per_second / len(self.on_link)
        self.now = at
