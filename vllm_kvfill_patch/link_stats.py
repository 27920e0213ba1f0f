"""The link's transfers in vLLM's own metrics (part of the opt-in ``link``
on workers; the ``link-metrics`` part where the stats are read), documented
once here.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnector.get_kv_connector_stats`` on each worker
    (:func:`collect`), and the class methods
    ``DecodeBenchConnector.build_kv_connector_stats`` (:func:`build_stats`)
    and ``DecodeBenchConnector.build_prom_metrics`` (:func:`build_prom`),
    which vLLM's stat loggers call in the API server's process, all
    inherited from vLLM's base connector.

Why
    A NIXL decode node's reads show in ``/metrics``
    (``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_bytes_transferred``,
    ``vllm:nixl_num_failed_transfers``) and in the periodic "KV Transfer
    metrics" log line; without the link's there, a dashboard cannot tell
    the emulated node's transfers from none.

How
    Each worker collects the transfers it reported since vLLM last asked
    (bytes on its rank, seconds from the step that admitted it to its
    report, failed or not) and hands them over as :class:`LinkStats`; vLLM
    aggregates the workers' stats, sends them to the API server, and there
    builds them back through ``build_kv_connector_stats`` and records them
    through ``build_prom_metrics`` as NIXL's are, under names that say they
    are emulated: ``vllm:emulated_kv_xfer_time_seconds``,
    ``vllm:emulated_kv_bytes_transferred`` (histograms: ``_count`` is the
    transfers, ``_sum`` their bytes) and
    ``vllm:emulated_kv_num_failed_transfers``. Stats that are not the
    link's get upstream's answers; a server without the link shows the
    link's metrics at 0.

Upstream
    The stats API: ``KVConnectorStats``, ``KVConnectorPromMetrics``
    (``kv_connector/v1/metrics.py``); NixlConnector's ``nixl/stats.py``.

Versions
    Every release the link applies to (0.11.1 - 0.34 today): each has the
    stats API (``gating`` checks both class methods).

Remove when
    The link part goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_kvfill_patch.link import MODEL_ATTR, arrivals_of

SECONDS = "emulated_link_seconds"
"""Per transfer reported: seconds from its admission to its report."""
BYTES = "emulated_link_bytes"
"""Per transfer reported: the bytes it carried on its rank."""
FAILED = "emulated_link_failed"
"""Per failed transfer reported: 1."""

TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BYTE_BUCKETS = tuple(2 ** (11 + 2 * i) for i in range(12))
"""2 KiB to 8 GiB, a factor of 4 apart."""


@dataclass
class LinkStats:
    """The link's transfers reported over an interval, by one worker or
    aggregated over several: vLLM's ``KVConnectorStats`` interface, which
    vLLM only calls (not subclassed, so that this part imports nothing of
    vLLM's connector package while vLLM is still importing it)."""

    data: dict[str, list] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def to_dict(self) -> dict[str, list]:
        return self.data

    def reset(self) -> None:
        self.data = {SECONDS: [], BYTES: [], FAILED: []}

    def aggregate(self, other: Any) -> LinkStats:
        for key in (SECONDS, BYTES, FAILED):
            self.data[key] = [*self.data[key], *other.data.get(key, ())]
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = sorted(self.data[SECONDS])
        return {
            "Emulated transfers": len(seconds),
            "Emulated failed transfers": len(self.data[FAILED]),
            "Emulated avg xfer time (ms)": round(
                1e3 * sum(seconds) / max(len(seconds), 1), 3
            ),
            "Emulated max xfer time (ms)": round(1e3 * max(seconds, default=0), 3),
            "Emulated MB transferred": round(sum(self.data[BYTES]) / 2**20, 3),
        }

    def is_empty(self) -> bool:
        return not self.data[SECONDS]


def collect(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnector.get_kv_connector_stats``: a link
    worker's transfers reported since the last call."""
    stats = wrapped(*args, **kwargs)
    worker = getattr(connector, "connector_worker", None)
    if stats is not None or getattr(worker, MODEL_ATTR, None) is None:
        return stats
    reported = arrivals_of(worker).take_reported()
    if not reported:
        return None
    return LinkStats(
        {
            SECONDS: [transfer.seconds for transfer in reported],
            BYTES: [transfer.nbytes for transfer in reported],
            FAILED: [1 for transfer in reported if transfer.failed],
        }
    )


def build_stats(wrapped: Any, connector_cls: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnector.build_kv_connector_stats``: the
    link's stats, from the data vLLM carried to the stat logger."""
    data = _data_argument(*args, **kwargs)
    if isinstance(data, dict) and SECONDS in data:
        return LinkStats(dict(data))
    return wrapped(*args, **kwargs)


def build_prom(wrapped: Any, connector_cls: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnector.build_prom_metrics``: the link's
    metrics, on every server of the connector (at 0 where no link carried
    anything: the link can be switched on at run time, as the fidelity tool
    does), where upstream registers none."""
    metrics = wrapped(*args, **kwargs)
    return metrics if metrics is not None else LinkPromMetrics(*args, **kwargs)


class LinkPromMetrics:
    """The link's Prometheus metrics, one child per engine, as NIXL's:
    vLLM's ``KVConnectorPromMetrics`` interface (``observe``), made with
    the metric classes vLLM hands over."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from prometheus_client import Counter, Histogram  # vLLM's own dependency

        def per_engine(kind: type, name: str, what: str, **options: Any) -> dict:
            metric = metric_types[kind](
                name=f"vllm:emulated_kv_{name}",
                documentation=f"Emulated KV transfers (vllm-kvfill-patch's link "
                f"model): {what}.",
                labelnames=labelnames,
                **options,
            )
            return {
                engine: metric.labels(*values)
                for engine, values in per_engine_labelvalues.items()
            }

        self.seconds = per_engine(
            Histogram,
            "xfer_time_seconds",
            "seconds from admission to the workers' report",
            buckets=TIME_BUCKETS,
        )
        self.bytes = per_engine(
            Histogram,
            "bytes_transferred",
            "bytes each carried on a worker's rank",
            buckets=BYTE_BUCKETS,
        )
        self.failed = per_engine(
            Counter,
            "num_failed_transfers",
            "failed ones, as transfer_failure_rate draws them",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for seconds in transfer_stats_data.get(SECONDS, ()):
            self.seconds[engine_idx].observe(seconds)
        for nbytes in transfer_stats_data.get(BYTES, ()):
            self.bytes[engine_idx].observe(nbytes)
        if failed := len(transfer_stats_data.get(FAILED, ())):
            self.failed[engine_idx].inc(failed)


def _data_argument(data: Any = None, *args: Any, **kwargs: Any) -> Any:
    return data


WORKER_WRAPPERS = {"DecodeBenchConnector.get_kv_connector_stats": collect}
"""What the link part wraps on workers, by dotted path in the connector module."""
READER_WRAPPERS = {
    "DecodeBenchConnector.build_kv_connector_stats": build_stats,
    "DecodeBenchConnector.build_prom_metrics": build_prom,
}
"""What the link-metrics part wraps wherever vLLM reads the stats."""
