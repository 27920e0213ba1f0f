"""The third patch, documented once here: after a prefix-cache hit, the
blocks after the hit are filled, not the hit.

Target
    ``vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector``:
    ``DecodeBenchConnector.update_state_after_alloc`` (which hands the call
    to its scheduler side, ``DecodeBenchConnectorScheduler``) is wrapped by
    :func:`record_blocks_after_hit`: the connector holds the KV-cache config.
    Scheduler side only; the worker fills the recorded blocks as it fills
    any request's (``worker_step``).

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
    (``preemption``) goes the same way.

How
    After upstream's method has recorded the request, its block ids are
    replaced by those holding the matched tokens: with ``n`` tokens to have
    computed (all but the last) of which ``n - num_external_tokens`` were
    hit, blocks ``(n - num_external_tokens) // block_size`` up to
    ``cdiv(n, block_size)`` of each group, null blocks (a Mamba group's
    padding, a sliding window's dropped blocks) left out, as upstream 0.30+
    does. The block size is each group's own (its spec's): groups can
    differ, where vLLM raises a group's block size to give every group one
    page size (the scheduler then hits at their common multiple); the
    scheduler's ``cache_config.block_size`` only where the connector has no
    KV-cache config (0.11.x may build it without). Under decode or prefill
    context parallelism a block holds more tokens than its spec's size, in
    the groups each release chooses (all of them, or full attention only):
    there upstream's record stays, and a warning says so once.

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

from vllm_kvfill_patch.fill_once import allocation_arguments

logger = init_logger("vllm.kvfill_patch")


def record_blocks_after_hit(
    wrapped: Any, connector: Any, args: tuple, kwargs: dict
) -> Any:
    """Wrapper of ``DecodeBenchConnector.update_state_after_alloc``."""
    result = wrapped(*args, **kwargs)
    request, blocks, num_external_tokens = allocation_arguments(*args, **kwargs)
    scheduler = connector.connector_scheduler
    pending = scheduler._pending_fills.get(request.request_id)
    if pending is None or num_external_tokens <= 0:
        return result
    block_sizes = _group_block_sizes(connector, scheduler, len(blocks.blocks))
    if block_sizes is None:
        return result
    block_ids_per_group, recorded_tokens = pending
    num_tokens = request.num_tokens - 1
    num_hit_tokens = num_tokens - num_external_tokens
    after_hit = tuple(
        [
            block.block_id
            for block in group[num_hit_tokens // size : -(-num_tokens // size)]
            if not block.is_null
        ]
        for group, size in zip(blocks.blocks, block_sizes, strict=True)
    )
    scheduler._pending_fills[request.request_id] = (after_hit, recorded_tokens)
    if after_hit != block_ids_per_group:
        logger.debug(
            "vllm-kvfill-patch: request %s hit %d cached tokens; filling the "
            "blocks after them (%s), not %s",
            request.request_id,
            num_hit_tokens,
            after_hit,
            block_ids_per_group,
        )
    return result


def _group_block_sizes(
    connector: Any, scheduler: Any, num_groups: int
) -> tuple[int, ...] | None:
    """The tokens a block holds in each KV-cache group, or None under context
    parallelism or groups that do not match the blocks (upstream's record
    kept, said once)."""
    parallel = getattr(
        getattr(connector, "_vllm_config", None), "parallel_config", None
    )
    ranks = getattr(parallel, "decode_context_parallel_size", 1) * getattr(
        parallel, "prefill_context_parallel_size", 1
    )
    if ranks > 1:
        logger.warning_once(
            "vllm-kvfill-patch: with decode/prefill context parallelism (%d "
            "ranks) a KV block holds more tokens than its block size; after a "
            "prefix-cache hit the blocks upstream records are filled (the hit "
            "blocks first), not only the request's own",
            ranks,
        )
        return None
    kv_cache_config = getattr(connector, "_kv_cache_config", None)
    if kv_cache_config is None:
        return (scheduler.block_size,) * num_groups
    sizes = tuple(
        group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups
    )
    if len(sizes) != num_groups:
        logger.warning_once(
            "vllm-kvfill-patch: the scheduler passed blocks of %d KV-cache "
            "groups, the connector's config has %d; after a prefix-cache hit "
            "the blocks upstream records are filled",
            num_groups,
            len(sizes),
        )
        return None
    return sizes


WRAPPERS = {
    "DecodeBenchConnector.update_state_after_alloc": record_blocks_after_hit,
}
"""The attributes this part wraps, by dotted path in the connector module."""
