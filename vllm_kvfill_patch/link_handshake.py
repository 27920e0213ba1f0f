"""The link's handshake (part of the opt-in ``link``), documented once here:
every worker announces its link part, and the scheduler side turns the link
on only where every worker of every stage has.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnector.get_handshake_metadata`` on each worker
    (:func:`announce`) and ``DecodeBenchConnector.
    set_xfer_handshake_metadata_pp_aware`` on the scheduler side
    (:func:`check_announced`), both inherited from vLLM's base connector.

Why
    With the link on, the scheduler side answers ``(n, True)`` on its own
    state, and vLLM's ``KVOutputAggregator`` schedules a request once every
    worker has reported its KV received. A worker without the link part (a
    node without the package, ``KVFILL_PATCH_DISABLE=1`` in one process, a
    part refused there) never reports: each request would hold its blocks in
    ``WAITING_FOR_REMOTE_KVS`` for ever, with no error anywhere.

How
    NixlConnector learns its workers through vLLM's handshake channel: the
    engine core gathers each worker's ``get_handshake_metadata()`` at
    startup, keyed by ``(pp_rank, tp_rank)``, and hands them to the
    scheduler side. With the link on, each worker's connector announces an
    :class:`Announcement`: its bytes per block for every KV-cache group,
    from its own layers' specs (a stage's own layers under pipeline
    parallelism). The scheduler side then requires one from every rank of
    every stage; a missing one stops the engine at startup with an error
    naming the option, the worker and why. The link carries, per group, the
    most any rank reads: a transfer is done when its slowest rank's is.
    Where the engine core's process lacks the package (its workers have it),
    upstream's setter takes the announcements: under pipeline parallelism it
    refuses those of stage 1 and up, and the engine stops saying so.

Upstream
    The channel: ``get_handshake_metadata`` and
    ``set_xfer_handshake_metadata`` (NixlConnector's), made PP-aware by
    ``set_xfer_handshake_metadata_pp_aware``; the engine core calls it
    whenever a KV connector is configured (``v1/engine/core.py``).

Versions
    Every release the link applies to (0.11.1 - 0.34 today): the engine
    core calls the PP-aware setter from 0.23, ``set_xfer_handshake_metadata``
    keyed by tensor rank alone before. There, under pipeline parallelism, a
    stage's worker that announced hides a silent one of the same tensor rank
    in another stage (vLLM merges their keys).

Remove when
    The link part goes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import product, zip_longest
from typing import Any

from vllm_kvfill_patch.link import MODEL_ATTR, bytes_per_block, link_of

OPTIONS_NAMED = "kv_connector_extra_config 'transfer_latency_ms' / 'transfer_gbps'"


@dataclass(frozen=True)
class Announcement:
    """A worker's link part, announced at startup: what one block of each
    KV-cache group carries on this rank (its own layers only). vLLM passes
    handshake metadata through without looking inside (its base class,
    ``KVConnectorHandshakeMetadata``, is empty): not subclassed, so that
    this part imports nothing of vLLM's connector package while vLLM is
    still importing it."""

    bytes_per_block: tuple[int, ...]


def announce(wrapped: Any, connector: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper of ``DecodeBenchConnector.get_handshake_metadata``: a worker
    whose connector has the link on announces it (upstream's answer, None,
    otherwise)."""
    metadata = wrapped(*args, **kwargs)
    worker = getattr(connector, "connector_worker", None)
    if metadata is not None or getattr(worker, MODEL_ATTR, None) is None:
        return metadata
    kv_cache_config = getattr(connector, "_kv_cache_config", None)
    sizes = bytes_per_block(kv_cache_config) if kv_cache_config is not None else ()
    return Announcement(sizes)


def check_announced(
    pp_aware: bool, wrapped: Any, connector: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnector.set_xfer_handshake_metadata_pp_aware``
    (``set_xfer_handshake_metadata`` up to 0.22, keyed by tensor rank alone):
    with the link on, every worker must have announced its link part."""
    link = link_of(getattr(connector, "connector_scheduler", None))
    metadata = _metadata_argument(*args, **kwargs)
    if link is None:
        return wrapped(*args, **kwargs)
    announced = {
        rank: said for rank, said in metadata.items() if isinstance(said, Announcement)
    }
    ranks: list[Any] = expected_ranks(connector._vllm_config)
    if not pp_aware:  # up to 0.22: {tp_rank: ...}
        ranks = sorted({tp for _, tp in ranks})
    missing = sorted(set(ranks) - set(announced))
    if missing:
        raise RuntimeError(refusal(missing, metadata))
    # Old vLLMs give workers no KV-cache config: no sizes to announce.
    if sizes := [
        said.bytes_per_block for said in announced.values() if said.bytes_per_block
    ]:
        link.bytes_per_block = tuple(map(max, zip_longest(*sizes, fillvalue=0)))
    rest = {rank: said for rank, said in metadata.items() if rank not in announced}
    return wrapped(rest)


def expected_ranks(vllm_config: Any) -> list[tuple[int, int]]:
    """The ``(pp_rank, tp_rank)`` keys vLLM's workers announce under."""
    parallel = vllm_config.parallel_config
    tensor = parallel.tensor_parallel_size
    # vLLM's workers fold the prefill context rank into the tensor rank
    # where both context parallelisms are on (gpu_worker.py).
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    if pcp > 1 and dcp > 1:
        tensor *= pcp
    return list(product(range(parallel.pipeline_parallel_size), range(tensor)))


def refusal(missing: list, metadata: dict) -> str:
    workers = ", ".join(
        f"(pp {rank[0]}, tp {rank[1]})" if isinstance(rank, tuple) else f"(tp {rank})"
        for rank in missing
    )
    other = {rank: type(said).__name__ for rank, said in metadata.items()}
    return (
        f"DecodeBenchConnector: {OPTIONS_NAMED} (the link model) need "
        "vllm-kvfill-patch's link part in every worker, and worker "
        f"{workers} did not announce it at startup (announced instead: "
        f"{other or 'nothing'}). Its process does not have the package applied: "
        "not installed there, KVFILL_PATCH_DISABLE=1, or refused (its log line "
        "'vllm-kvfill-patch ... for vLLM' says which). It would never report a "
        "transfer, and every request would wait for its KV for ever."
    )


def _metadata_argument(metadata: dict, *args: Any, **kwargs: Any) -> dict:
    return metadata


def wrappers(connector_cls: type) -> dict[str, Any]:
    """The attributes this module wraps, by dotted path in the connector
    module: the one setter vLLM's engine core calls (the PP-aware one from
    0.23, which calls the other)."""
    setter = next(
        name
        for name in (
            "set_xfer_handshake_metadata_pp_aware",
            "set_xfer_handshake_metadata",
        )
        if hasattr(connector_cls, name)
    )
    pp_aware = setter.endswith("_pp_aware")
    return {
        "DecodeBenchConnector.get_handshake_metadata": announce,
        f"DecodeBenchConnector.{setter}": functools.partial(check_announced, pp_aware),
    }
