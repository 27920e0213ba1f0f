"""The third patch, documented once here: after a prefix-cache hit, the
blocks after the hit are filled, not the hit.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnectorScheduler.update_state_after_alloc`` is wrapped by
    :func:`record_blocks_after_hit`. Scheduler side only; the worker fills
    the recorded blocks as it fills any request's (``replacement``).

Why
    The scheduler side tells vLLM that every token but the last, minus what
    the prefix cache already holds, is "external" (matched), then records
    the blocks to fill. vLLM hands ``update_state_after_alloc`` all of the
    request's blocks, the prefix-cache hit first. Up to 0.29 it records the
    *first* ``cdiv(num_external_tokens, block_size)`` blocks of each group:
    with a hit (prefix caching is on by default, and ``vllm bench serve
    --random-prefix-len`` makes hits the norm) that is the cached prefix,
    shared with other requests, which is overwritten, while the request's
    own last blocks are never filled. The refill after preemption
    (``refill``) goes the same way.

How
    After upstream's method has recorded the request, its block ids are
    replaced by those holding the matched tokens: with ``n`` tokens to have
    computed (all but the last) of which ``n - num_external_tokens`` were
    hit, blocks ``(n - num_external_tokens) // block_size`` up to
    ``cdiv(n, block_size)`` of each group, null blocks (a Mamba group's
    padding, a sliding window's dropped blocks) left out. The block size is
    the scheduler's own (``cache_config.block_size``, what upstream used):
    up to 0.29 every group that can hit the prefix cache has it (a Mamba
    group's is the attention block size when prefix caching is on). The
    same arithmetic as upstream 0.30+.

Upstream
    #54878 (0.30.0): the blocks after the hit, null blocks dropped.
    ``patches/v0.23.0/0002`` carries it for forks of 0.23.

Versions
    0.11.1 - 0.29.x: the gating probes upstream's own method with a one-block
    hit (``gating``) and applies this part where it records the hit block.

Remove when
    Your vLLM records the blocks after the hit (0.30+): the probe then finds
    nothing and this part stays out by itself.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

logger = init_logger("vllm.kvfill_patch")


def record_blocks_after_hit(
    wrapped: Any, scheduler: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnectorScheduler.update_state_after_alloc``."""
    result = wrapped(*args, **kwargs)
    request, blocks, num_external_tokens = _arguments(*args, **kwargs)
    pending = scheduler._pending_fills.get(request.request_id)
    if pending is None or num_external_tokens <= 0:
        return result
    block_ids_per_group, recorded_tokens = pending
    num_tokens = request.num_tokens - 1
    first = (num_tokens - num_external_tokens) // scheduler.block_size
    end = -(-num_tokens // scheduler.block_size)
    after_hit = tuple(
        [block.block_id for block in group[first:end] if not block.is_null]
        for group in blocks.blocks
    )
    scheduler._pending_fills[request.request_id] = (after_hit, recorded_tokens)
    if first:
        logger.debug(
            "vllm-kvfill-patch: request %s hit %d cached blocks; filling the "
            "blocks after them (%s), not %s",
            request.request_id,
            first,
            after_hit,
            block_ids_per_group,
        )
    return result


WRAPPERS = {
    "DecodeBenchConnectorScheduler.update_state_after_alloc": record_blocks_after_hit,
}
"""The attributes this part wraps, by dotted path in the connector module."""


def _arguments(
    request: Any, blocks: Any, num_external_tokens: int
) -> tuple[Any, Any, int]:
    return request, blocks, num_external_tokens
