"""What the scheduler side fills: once per request by default, as a decode
node takes a request's KV once; a preempted request again where the refill
is asked for; the blocks after a prefix-cache hit.

Scheduler side of the real DecodeBenchConnector of the installed release,
with real ``Request`` objects, scheduled and preempted the way vLLM's
``Scheduler`` does it. Tests marked ``behaviour`` also run against the patch
files (see test_connector.py); the others compare with upstream's own
behaviour.
"""

from __future__ import annotations

import pytest

from tests.helpers import applied_parts, opt_ins_forgotten, overlay_reverted
from tests.hybrid import BLOCK_SIZE, PROMPT_LEN, make_request, scheduler_connector
from vllm_kvfill_patch.releases import parse_release

behaviour = pytest.mark.behaviour
pytestmark = pytest.mark.usefixtures("implementation")
GENERATED = 3


@pytest.fixture
def connector(vllm_config_for):
    """A real scheduler-role DecodeBenchConnector over one attention group."""
    config = vllm_config_for(fill_mean=0.5)
    config.cache_config.block_size = BLOCK_SIZE  # what the platform would set
    return scheduler_connector(config, [BLOCK_SIZE])


@pytest.fixture
def refill_connector(vllm_config_for):
    """The same, with the refill asked for in its options."""
    config = vllm_config_for(fill_mean=0.5, refill_preempted=True)
    config.cache_config.block_size = BLOCK_SIZE
    with opt_ins_forgotten():
        yield scheduler_connector(config, [BLOCK_SIZE])


def schedule(connector, request, first_block: int, num_computed_tokens: int = 0):
    """One scheduling of `request` as vLLM's scheduler does it: matched
    tokens, allocation of fresh blocks from `first_block` on (told to the
    connector whatever was matched), then the step's metadata. Returns
    (matched tokens, the step's reqs_to_fill)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.request import RequestStatus

    matched, _ = connector.get_num_new_matched_tokens(request, num_computed_tokens)
    count = -(-request.num_tokens // BLOCK_SIZE)
    blocks = [
        KVCacheBlock(block_id) for block_id in range(first_block, first_block + count)
    ]
    connector.update_state_after_alloc(request, KVCacheBlocks((blocks,)), matched)
    metadata = connector.build_connector_meta(None)
    request.status = RequestStatus.RUNNING
    request.num_computed_tokens = num_computed_tokens + matched
    return matched, metadata.reqs_to_fill


def generate_and_preempt(request, tokens: int = GENERATED) -> None:
    """Decode `tokens`, then what ``Scheduler._preempt_request`` does."""
    from vllm.v1.request import RequestStatus

    request.append_output_token_ids(list(range(100, 100 + tokens)))
    request.status = RequestStatus.PREEMPTED
    request.num_computed_tokens = 0
    request.num_preemptions += 1


@behaviour
def test_by_default_a_resumed_request_is_recomputed_as_on_a_decode_node(connector):
    request = make_request("r")
    matched, fills = schedule(connector, request, first_block=1)
    assert matched == PROMPT_LEN - 1 and list(fills) == ["r"]
    generate_and_preempt(request)
    assert schedule(connector, request, first_block=20) == (0, {})


@behaviour
def test_a_one_token_prompt_is_never_offered_its_history_after_a_preemption(
    connector,
):
    """#57419: a request admitted with nothing to fill is filled once too."""
    request = make_request("one", prompt_len=1)
    assert schedule(connector, request, first_block=1) == (0, {})
    generate_and_preempt(request)
    assert schedule(connector, request, first_block=20) == (0, {})


@behaviour
def test_with_the_refill_a_resumed_request_is_filled_again_at_its_new_blocks(
    refill_connector,
):
    connector = refill_connector
    request = make_request("r")
    matched, fills = schedule(connector, request, first_block=1)
    assert matched == PROMPT_LEN - 1 and list(fills) == ["r"]
    generate_and_preempt(request)
    matched, fills = schedule(connector, request, first_block=20)
    # As a new request of the same tokens at the same blocks is filled.
    twin = make_request("twin", PROMPT_LEN + GENERATED)
    twin_matched, twin_fills = schedule(connector, twin, first_block=20)
    assert matched == twin_matched == PROMPT_LEN + GENERATED - 1
    assert fills == {"r": twin_fills["twin"]}
    assert 20 in fills["r"][0][0] and 1 not in fills["r"][0][0]


@behaviour
def test_with_the_refill_a_resumed_request_after_a_hit_fills_the_rest(
    refill_connector,
):
    connector = refill_connector
    request = make_request("r")
    schedule(connector, request, first_block=1)
    generate_and_preempt(request)
    matched, fills = schedule(connector, request, 20, num_computed_tokens=BLOCK_SIZE)
    assert matched == PROMPT_LEN + GENERATED - 1 - BLOCK_SIZE
    # Blocks 20 .. 22 hold its 43 tokens; 20 is the hit.
    assert fills == {"r": (([21, 22],), matched)}


@behaviour
@pytest.mark.parametrize("hit_blocks", [1, 2])
def test_after_a_prefix_cache_hit_the_blocks_after_it_are_filled(connector, hit_blocks):
    request = make_request("r")  # 40 tokens: blocks 1 .. 3
    hit_tokens = hit_blocks * BLOCK_SIZE
    matched, fills = schedule(connector, request, 1, num_computed_tokens=hit_tokens)
    assert matched == PROMPT_LEN - 1 - hit_tokens
    assert fills == {"r": ((list(range(1 + hit_blocks, 4)),), matched)}


@behaviour
def test_after_a_hit_each_group_is_filled_by_its_own_block_size(vllm_config_for):
    """vLLM raises a group's block size where the groups' pages differ; the
    scheduler then hits at their common multiple (here 64 tokens)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    connector = scheduler_connector(
        vllm_config_for(fill_mean=0.5), [BLOCK_SIZE, 2 * BLOCK_SIZE]
    )
    request = make_request("r", prompt_len=100)  # 99 tokens to have computed
    hit = 4 * BLOCK_SIZE
    matched, _ = connector.get_num_new_matched_tokens(request, hit)
    small = [KVCacheBlock(b) for b in range(1, 8)]  # 7 blocks of 16 tokens
    large = [KVCacheBlock(b) for b in range(20, 24)]  # 4 blocks of 32
    connector.update_state_after_alloc(request, KVCacheBlocks((small, large)), matched)
    fills = connector.build_connector_meta(None).reqs_to_fill
    assert fills == {"r": (([5, 6, 7], [22, 23]), matched)}


def test_under_context_parallelism_a_hit_is_recorded_as_upstream_does(
    vllm_config_for, vllm_version, vllm_log
):
    """A block holds more tokens than its spec says there, in groups each
    release picks its own way: the overlay keeps upstream's record and says
    so once, where it has the prefix-hit part."""
    import copy

    config = copy.deepcopy(vllm_config_for(fill_mean=0.5))
    config.cache_config.block_size = BLOCK_SIZE
    config.parallel_config.decode_context_parallel_size = 2

    def hit_of_one_block():
        request = make_request("r")
        connector = scheduler_connector(config, [BLOCK_SIZE])
        return schedule(connector, request, 1, num_computed_tokens=BLOCK_SIZE)

    ours = hit_of_one_block()
    with overlay_reverted():
        upstream = hit_of_one_block()
    assert ours == upstream
    warnings = [r for r in vllm_log if "context parallelism" in r.getMessage()]
    assert len(warnings) == int("prefix-hit" in applied_parts(vllm_version))


def test_blocks_of_more_groups_than_the_config_are_recorded_as_upstream_does(
    vllm_config_for, vllm_version, vllm_log
):
    """Bad input: the overlay cannot tell those groups' block sizes, so it
    keeps upstream's record (up to 0.29) and says so once; 0.30+ upstream
    rejects it itself."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    def record():
        connector = scheduler_connector(vllm_config_for(fill_mean=0.5), [BLOCK_SIZE])
        request = make_request("r")
        matched, _ = connector.get_num_new_matched_tokens(request, BLOCK_SIZE)
        blocks = ([KVCacheBlock(b) for b in range(1, 4)],) * 2
        connector.update_state_after_alloc(request, KVCacheBlocks(blocks), matched)
        return connector.build_connector_meta(None).reqs_to_fill

    if "prefix-hit" not in applied_parts(vllm_version):
        with pytest.raises(ValueError):
            record()
    else:
        ours = record()
        with overlay_reverted():
            upstream = record()
        assert ours == upstream
        warnings = [r for r in vllm_log if "connector's config has 1" in r.getMessage()]
        assert len(warnings) == 1


@behaviour
def test_null_blocks_are_never_recorded(connector):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    request = make_request("r")
    matched, _ = connector.get_num_new_matched_tokens(request, 0)
    # A sliding window's or a Mamba group's padding: vLLM's null block 0.
    null = KVCacheBlock(0)
    null.is_null = True
    blocks = KVCacheBlocks(([null, KVCacheBlock(5), KVCacheBlock(6)],))
    connector.update_state_after_alloc(request, blocks, matched)
    assert connector.build_connector_meta(None).reqs_to_fill == {
        "r": (([5, 6],), matched)
    }


@behaviour
def test_a_refill_happens_once_per_scheduling(refill_connector):
    connector = refill_connector
    request = make_request("r")
    schedule(connector, request, first_block=1)
    generate_and_preempt(request)
    first, _ = connector.get_num_new_matched_tokens(request, 0)
    # Asked again before the allocation: nothing filled yet, the same answer.
    assert connector.get_num_new_matched_tokens(request, 0)[0] == first > 0
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in range(20, 23)],))
    connector.update_state_after_alloc(request, blocks, first)
    # The refill is pending in this scheduling: not a second one.
    assert connector.get_num_new_matched_tokens(request, 0)[0] == 0
    assert list(connector.build_connector_meta(None).reqs_to_fill) == ["r"]


@behaviour
def test_a_running_request_is_still_filled_once(connector):
    request = make_request("r")
    schedule(connector, request, first_block=1)
    request.append_output_token_ids([100])
    assert connector.get_num_new_matched_tokens(request, request.num_tokens - 1)[0] == 0


@behaviour
def test_finish_and_abort_clean_up_after_a_refill(refill_connector):
    connector = refill_connector
    for finish in ("request_finished", "abort"):
        request = make_request(finish)
        schedule(connector, request, first_block=1)
        generate_and_preempt(request)
        schedule(connector, request, first_block=20)
        # vLLM calls request_finished for finished and aborted requests alike.
        connector.request_finished(request, [])
        assert finish not in connector.connector_scheduler._filled_requests
        assert finish not in connector.connector_scheduler._pending_fills


def upstream_and_overlay(scenario) -> dict:
    """`scenario(name)` with upstream's own methods, then with the overlay."""
    with overlay_reverted():
        upstream = scenario("upstream")
    return {"upstream": upstream, "overlay": scenario("overlay")}


def test_upstream_and_the_overlay_recompute_a_resumed_request_by_default(
    connector, refill_connector
):
    def resume(connector, name):
        request = make_request(name)
        schedule(connector, request, first_block=1)
        generate_and_preempt(request)
        return schedule(connector, request, first_block=20)

    results = upstream_and_overlay(lambda name: resume(connector, name))
    # Nothing matched: vLLM recomputes its 43 tokens, as a decode node would.
    assert results == {"upstream": (0, {}), "overlay": (0, {})}
    # Asked for, the overlay fills it again; upstream has no such option.
    refilled = upstream_and_overlay(lambda name: resume(refill_connector, name))
    assert refilled["upstream"] == (0, {})
    assert refilled["overlay"][0] == PROMPT_LEN + GENERATED - 1


def test_upstream_up_to_0_29_fills_the_hit_and_the_overlay_does_not(
    connector, vllm_version
):
    def hit_one_block(name):
        request = make_request(name)
        return schedule(connector, request, 1, num_computed_tokens=BLOCK_SIZE)

    results = upstream_and_overlay(hit_one_block)
    matched = PROMPT_LEN - 1 - BLOCK_SIZE
    assert results["overlay"] == (matched, {"overlay": (([2, 3],), matched)})
    if parse_release(vllm_version) < (0, 30, 0):
        assert results["upstream"] == (matched, {"upstream": (([1, 2],), matched)})
    else:  # #54878
        assert results["upstream"] == (matched, {"upstream": (([2, 3],), matched)})


def test_upstream_offers_a_one_token_prompts_history_and_the_overlay_does_not(
    connector,
):
    def resume_unfilled(name):
        request = make_request(f"{name}-one-token", prompt_len=1)
        first = schedule(connector, request, first_block=1)
        generate_and_preempt(request)
        return first, schedule(connector, request, first_block=20)[0]

    results = upstream_and_overlay(resume_unfilled)
    # A one-token prompt: nothing to fill at first; after a preemption with
    # 3 generated tokens upstream offers those 3 as external KV (#57419).
    assert results == {"upstream": ((0, {}), GENERATED), "overlay": ((0, {}), 0)}
