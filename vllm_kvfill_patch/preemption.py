"""The refill part (scheduler side, opt-in), documented once here: a
preempted request is filled again.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnectorScheduler.get_num_new_matched_tokens`` is wrapped by
    :func:`refill_after_preemption`. Scheduler side only; the worker fills
    the blocks as it fills any request's (``worker_step``).

Why
    The connector emulates a decode node. A decode node takes a request's KV
    once (NixlConnector, Mooncake P2P, LMCache-MP): when vLLM preempts a
    request (``Scheduler._preempt_request``: blocks freed,
    ``num_computed_tokens = 0``), it is recomputed locally when it resumes,
    minus what the prefix cache still holds. Upstream does the same
    (``_filled_requests``), and so does this package by default. A node with
    an offload tier for preempted requests (vllm-ascend's
    ``PreemptOffloadConnector``, a KV store, an offloading connector in a
    ``MultiConnector``) loads their KV back instead: this part emulates that
    node, for the benchmarks that want it.

How
    Off unless asked for: ``refill_preempted: true`` in the connector's
    ``kv_connector_extra_config`` (``options`` keeps the answer on the
    scheduler side), or ``KVFILL_PATCH_REFILL=1`` for every connector of the
    process. Where it is in force, a request that comes back preempted
    (``status == PREEMPTED``) is taken out of ``_filled_requests`` before
    upstream's method runs, so upstream treats it as new: all tokens but the
    last, minus what the prefix cache holds, are reported as matched, and the
    worker fills the new blocks in the next step. A request with a fill
    pending in this scheduling (``_pending_fills``) is left alone. Cleanup on
    finish and abort is upstream's (``request_finished``).

Upstream
    #25986 (the connector; "only fill once per request"). No release has the
    option; ``patches/v0.34.0/0005`` proposes it as ``refill_preempted``, off
    by default (``patches/v0.33.0/0005`` and ``patches/v0.23.0/0005`` for
    forks).

Versions
    Every release with the connector (0.11.1 - 0.34 today): the gating
    probes upstream's own method with a preempted request it has filled
    before (``gating``); where the answer is 0 (recomputed), the option can
    change it. ``KVFILL_PATCH_REFILL=0`` leaves this part out altogether.

Remove when
    Your vLLM's connector has such an option: use it instead.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

from vllm_kvfill_patch import switches
from vllm_kvfill_patch.options import REFILL_ATTR

logger = init_logger("vllm.kvfill_patch")


def refill_after_preemption(
    wrapped: Any, scheduler: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnectorScheduler.get_num_new_matched_tokens``."""
    request = _request_argument(*args, **kwargs)
    request_id = request.request_id
    if (
        refill_in_force(scheduler)
        and request.status == RequestStatus.PREEMPTED
        and request_id in scheduler._filled_requests
        and request_id not in scheduler._pending_fills
    ):
        scheduler._filled_requests.discard(request_id)
        logger.debug(
            "vllm-kvfill-patch: request %s resumes after preemption %d; "
            "filling it again instead of recomputing it (refill_preempted)",
            request_id,
            request.num_preemptions,
        )
    return wrapped(*args, **kwargs)


WRAPPERS = {
    "DecodeBenchConnectorScheduler.get_num_new_matched_tokens": (
        refill_after_preemption
    ),
}
"""The attributes this part wraps, by dotted path in the connector module."""


def refill_in_force(scheduler: Any) -> bool:
    """What the connector's options decided when it was built; for a
    connector built before the patch went in, the switch alone."""
    decided = getattr(scheduler, REFILL_ATTR, None)
    return switches.refill_switch() is True if decided is None else decided


def _request_argument(request: Any, *args: Any, **kwargs: Any) -> Any:
    return request
