"""What a decode server's vLLM metrics say it received, through NIXL or over
the package's emulated link: bytes, transfers, failures, the transfer-time
histogram, and where its prompt tokens came from (from prefill, or computed
locally)."""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass


class Source(enum.Enum):
    """Whose transfers vLLM's metrics count, by their names' prefix: the
    same three metrics under each."""

    NIXL = "vllm:nixl_"
    EMULATED = "vllm:emulated_kv_"
    """The package's link model (``link_stats``)."""

    @property
    def way(self) -> str:
        return "through NIXL" if self is Source.NIXL else "over the emulated link"

    @property
    def histogram(self) -> str:
        return "NIXL histogram" if self is Source.NIXL else "emulated link's histogram"


@dataclass(frozen=True)
class Transfers:
    """What the decode server's metrics say it received."""

    count: float
    bytes: float
    failed: float
    external_tokens: float
    """Prompt tokens whose KV came from prefill."""
    local_tokens: float
    """Prompt tokens decode computed itself (one per request: the last)."""
    seconds: tuple[tuple[float, float], ...]
    """The transfer-time histogram: (upper bound, cumulative count)."""
    total_seconds: float = 0.0
    """The transfer times added up (the histogram's sum)."""
    source: Source = Source.NIXL

    def quantile(self, q: float) -> float | None:
        """The q-quantile of the transfer time in seconds, linear within its
        bucket (Prometheus's `histogram_quantile`); None with no transfer."""
        return histogram_quantile(self.seconds, q)

    def mean_seconds(self) -> float | None:
        """The mean transfer time; None with no transfer."""
        return self.total_seconds / self.count if self.count > 0 else None

    def bytes_each(self) -> float:
        """The mean bytes a transfer."""
        return self.bytes / self.count if self.count > 0 else 0.0

    def minus(self, before: Transfers) -> Transfers:
        """What arrived since `before`."""
        return self.combined(before, -1)

    def plus(self, other: Transfers) -> Transfers:
        """Both together (two legs' transfers)."""
        return self.combined(other, 1)

    def combined(self, other: Transfers, sign: int) -> Transfers:
        """Each figure and histogram bucket of `other`, times `sign`, added."""
        other_buckets = dict(other.seconds)
        return Transfers(
            self.count + sign * other.count,
            self.bytes + sign * other.bytes,
            self.failed + sign * other.failed,
            self.external_tokens + sign * other.external_tokens,
            self.local_tokens + sign * other.local_tokens,
            tuple(
                (bound, count + sign * other_buckets.get(bound, 0.0))
                for bound, count in self.seconds
            ),
            self.total_seconds + sign * other.total_seconds,
            self.source,
        )

    def timing(self) -> str:
        """The time per transfer in words: p50 and p99."""
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        if p50 is None or p99 is None:
            return "no transfer timed"
        return f"transfer time p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"

    def said(self) -> str:
        """The transfers in words: bytes, count, failures, time per transfer."""
        timing = self.timing()
        return (
            f"received {self.bytes:,.0f} bytes {self.source.way} in "
            f"{self.count:.0f} transfers ({self.bytes_each():,.0f} a request), "
            f"{self.failed:.0f} failed; "
            f"{timing} (vLLM's {self.source.histogram}); prompt tokens from prefill "
            f"{self.external_tokens:,.0f}, computed here {self.local_tokens:,.0f}"
        )

    def problem(self, requests: int) -> str | None:
        """Why `requests` requests were not decoded from transferred KV, or
        None: the reference is real or the run fails by name."""
        if self.bytes <= 0 or self.count <= 0:
            return "the decode node received no KV through NIXL"
        if self.failed:
            return f"{self.failed:.0f} NIXL transfers failed"
        if self.local_tokens > requests:
            return (
                f"the decode node computed {self.local_tokens:.0f} prompt tokens "
                f"itself for {requests} requests: a fallback to local prefill"
            )
        return None


def histogram_quantile(
    buckets: tuple[tuple[float, float], ...], q: float
) -> float | None:
    """The q-quantile of a cumulative histogram, linear within the bucket
    that holds it; None when it is empty."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1)
        lower, below = bound, count
    return lower


def read_transfers(metrics: str, source: Source = Source.NIXL) -> Transfers:
    """`Transfers` of `source` from a Prometheus page of vLLM's metrics."""

    def total(name: str, label: str = "") -> float:
        pattern = rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$"
        return sum(
            float(value)
            for labels, value in re.findall(pattern, metrics, re.MULTILINE)
            if label in labels
        )

    buckets: dict[float, float] = {}
    prefix = re.escape(source.value)
    for labels, value in re.findall(
        rf"^{prefix}xfer_time_seconds_bucket{{([^}}]*)}} (\S+)$", metrics, re.MULTILINE
    ):
        bound = float(re.search(r'le="([^"]+)"', labels)[1])  # type: ignore[index]
        buckets[bound] = buckets.get(bound, 0.0) + float(value)
    return Transfers(
        count=total(f"{source.value}xfer_time_seconds_count"),
        bytes=total(f"{source.value}bytes_transferred_sum"),
        failed=total(f"{source.value}num_failed_transfers_total"),
        external_tokens=total(
            "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"'
        ),
        local_tokens=total(
            "vllm:prompt_tokens_by_source_total", 'source="local_compute"'
        ),
        seconds=tuple(sorted(buckets.items())),
        total_seconds=total(f"{source.value}xfer_time_seconds_sum"),
        source=source,
    )
