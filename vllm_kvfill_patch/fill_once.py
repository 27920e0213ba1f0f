"""The fill-once part (scheduler side), documented once here: a request
admitted with nothing to fill is remembered as filled.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnectorScheduler.update_state_after_alloc`` is wrapped by
    :func:`remember_zero_token_fill`.

Why
    The connector emulates a decode node, which takes a request's KV once
    (NixlConnector: "Only trigger 1 KV transfer per request."). Upstream's
    scheduler side keeps that rule with ``_filled_requests``, but records a
    request there only when it had tokens to fill. A one-token prompt has
    none: after vLLM preempts it, its generated tokens are offered as
    external KV, a second transfer that no decode node makes (it crashed a
    GLM-5.2 EP16 run composed with HiSparseConnector, upstream #57419).

How
    After upstream's method, a request allocated with ``num_external_tokens
    == 0`` is added to ``_filled_requests``, so it is told 0 matched tokens
    from then on and is recomputed after a preemption, like every other
    request. vLLM calls the method for every request it admits. Cleanup on
    finish and abort is upstream's (``request_finished``).

Upstream
    #57419 (open): remember zero-token fills. ``patches/v0.34.0/0004``
    carries it (``patches/v0.33.0/0004`` and ``patches/v0.23.0/0004`` for
    forks).

Versions
    Every release with the connector (0.11.1 - 0.34 today): the gating
    probes upstream's own methods with a one-token prompt preempted after
    three tokens (``gating``) and applies this part where it is offered them.

Remove when
    Your vLLM's connector remembers zero-token fills: the probe then finds
    nothing and this part stays out by itself.
"""

from __future__ import annotations

from typing import Any


def remember_zero_token_fill(
    wrapped: Any, scheduler: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnectorScheduler.update_state_after_alloc``."""
    result = wrapped(*args, **kwargs)
    request, _blocks, num_external_tokens = allocation_arguments(*args, **kwargs)
    if num_external_tokens == 0:
        scheduler._filled_requests.add(request.request_id)
    return result


WRAPPERS = {
    "DecodeBenchConnectorScheduler.update_state_after_alloc": remember_zero_token_fill,
}
"""The attributes this part wraps, by dotted path in the connector module."""


def allocation_arguments(
    request: Any, blocks: Any, num_external_tokens: int
) -> tuple[Any, Any, int]:
    """``update_state_after_alloc``'s arguments, however they were passed."""
    return request, blocks, num_external_tokens
