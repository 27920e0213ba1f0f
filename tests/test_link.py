"""The link model: a request's KV arrives over a modelled link, through
vLLM's own async-load path.

vLLM's real ``Scheduler`` of the installed release builds the real
DecodeBenchConnector from a real VllmConfig; two real worker-role connectors
(two tensor-parallel ranks, each with its own pool) fill what the scheduler's
metadata hands them and report it from ``get_finished``; vLLM's own
``KVOutputAggregator`` counts the ranks' reports. The clock of the link and
of the workers is the test's, so that arrivals come exactly when the model
says.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import re

import numpy as np
import pytest
import torch

from tests.helpers import opt_ins_forgotten
from tests.hybrid import (
    BLOCK_SIZE,
    GDN_STATES,
    PAGE_BYTES,
    PROMPT_LEN,
    STATE_DTYPE,
    make_kv_cache_config,
    make_pool,
    make_request,
    make_worker_connector,
)
from vllm_kvfill_patch.link import arrivals_of

NUM_BLOCKS = 64
RANKS = 2
STATE_BYTES = sum(math.prod(shape) for shape in GDN_STATES) * STATE_DTYPE.itemsize


def runner_output_fields() -> dict[str, dataclasses.Field]:
    """``ModelRunnerOutput``'s fields of the installed release, by name."""
    from vllm.v1.outputs import ModelRunnerOutput

    return {field.name: field for field in dataclasses.fields(ModelRunnerOutput)}


def rank_kv_output(rank, finished_req_ids: set[str]):
    """A rank's connector output for a step, as vLLM's model runner asks
    for it (``kv_connector_model_runner_mixin``): the transfers finished
    (with the failed loads by request, 0.32+), the blocks that failed to
    load, the connector's stats."""
    from vllm.v1.outputs import KVConnectorOutput

    fields = {field.name for field in dataclasses.fields(KVConnectorOutput)}
    output = KVConnectorOutput()
    if "failed_recving" in fields:
        results = rank.get_transfer_results(finished_req_ids)
        output.finished_sending = results.finished_sending or None
        output.finished_recving = results.finished_recving or None
        output.failed_recving = results.failed_recving
    else:
        sending, recving = rank.get_finished(finished_req_ids)
        output.finished_sending, output.finished_recving = sending, recving
    if "invalid_block_ids" in fields:
        output.invalid_block_ids = rank.get_block_ids_with_load_errors()
    if "kv_connector_stats" in fields:
        output.kv_connector_stats = rank.get_kv_connector_stats()
    return output


class Clock:
    """The link's clock, in whole milliseconds (no rounding at the edges)."""

    def __init__(self) -> None:
        self.ms = 0

    def __call__(self) -> float:
        return self.ms / 1e3


class Node:
    """A decode node of vLLM's scheduler and two worker ranks."""

    def __init__(self, vllm_config, hybrid: bool = True, policy: str = "") -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            KVOutputAggregator,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.pools = [make_pool(NUM_BLOCKS) for _ in range(RANKS)]
        kv_cache_config = make_kv_cache_config(self.pools[0])
        if not hybrid:  # the attention group alone
            del kv_cache_config.kv_cache_groups[1:]
        vllm_config = copy.deepcopy(vllm_config)
        vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
        # The test's requests carry no block hashes.
        vllm_config.cache_config.enable_prefix_caching = False
        if hasattr(vllm_config.cache_config, "mamba_cache_mode"):
            vllm_config.cache_config.mamba_cache_mode = "none"
        if policy and hasattr(vllm_config.kv_transfer_config, "kv_load_failure_policy"):
            vllm_config.kv_transfer_config.kv_load_failure_policy = policy
        self.scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK_SIZE,
        )
        self.ranks = [
            make_worker_connector(vllm_config, pool, kv_cache_config)
            for pool in self.pools
        ]
        self.aggregator = KVOutputAggregator.from_connector(self.ranks[0], RANKS)
        self.clock = Clock()
        scheduler_side = self.scheduler.connector.connector_scheduler
        self.link = getattr(scheduler_side, "_kvfill_link", None)
        if self.link is not None:
            self.link.clock = self.clock
        for rank in self.ranks:
            arrivals_of(rank.connector_worker).clock = self.clock
        self.reports: list[list[set]] = []
        """Per step, what each rank reported received."""
        self.stats: list = []
        """The steps' connector stats, as vLLM's aggregator merged the ranks'."""

    def add(self, request_id: str, prompt_len: int = PROMPT_LEN):
        request = make_request(request_id, prompt_len)
        self.scheduler.add_request(request)
        return request

    def step(self, advance_ms: int = 0, forward_ms: int = 0):
        """One scheduler step: schedule, each rank's connector (its forward
        pass taking `forward_ms` between ``start_load_kv`` and
        ``get_finished``), the aggregated output back to the scheduler."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        fields_of = runner_output_fields()
        # A step's sampled tokens per request: arrays in 0.11, lists later.
        sampled = (
            np.array if "ndarray" in str(fields_of["sampled_token_ids"].type) else list
        )

        self.clock.ms += advance_ms
        output = self.scheduler.schedule()
        scheduled = list(output.num_scheduled_tokens)
        rank_outputs, reported = [], []
        for rank in self.ranks:
            rank.bind_connector_metadata(output.kv_connector_metadata)
            rank.start_load_kv(None)
        self.clock.ms += forward_ms
        for rank in self.ranks:
            kv_output = rank_kv_output(rank, output.finished_req_ids)
            rank.clear_connector_metadata()
            reported.append(set(kv_output.finished_recving or ()))
            fields = {
                "req_ids": scheduled,
                "sampled_token_ids": [sampled([7]) for _ in scheduled],
                "kv_connector_output": kv_output,
            }
            if "req_id_to_index" in fields_of:  # up to 0.33; derived in 0.34
                fields["req_id_to_index"] = {r: i for i, r in enumerate(scheduled)}
            rank_outputs.append(
                dataclasses.replace(EMPTY_MODEL_RUNNER_OUTPUT, **fields)
            )
        self.reports.append(reported)
        aggregated = self.aggregator.aggregate(rank_outputs)
        if stats := getattr(aggregated.kv_connector_output, "kv_connector_stats", None):
            self.stats.append(stats)
        self.scheduler.update_from_output(output, aggregated)
        return output

    def blocks(self, request_id: str) -> list[int]:
        manager = self.scheduler.kv_cache_manager
        return list(manager.get_block_ids(request_id)[0])

    def state_blocks(self, request_id: str) -> list[int]:
        """The request's state block (none where the node has no state group)."""
        manager = self.scheduler.kv_cache_manager
        groups = manager.get_block_ids(request_id)
        return [b for b in groups[1] if b != 0] if len(groups) > 1 else []

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def changed_pages(self, before: list[torch.Tensor]) -> list[set[int]]:
        """Per rank, the pages that differ from `before`."""
        changed = []
        for pool, old in zip(self.pools, before, strict=True):
            rows = (pool.pages() != old.view(NUM_BLOCKS, PAGE_BYTES)).any(dim=1)
            changed.append(set(rows.nonzero().flatten().tolist()))
        return changed


@pytest.fixture
def hybrid() -> bool:
    """Whether the node is the hybrid model's (an attention and a state
    group): where vLLM finishes async loads of one group only (up to 0.16),
    the node is its attention group alone."""
    from vllm_kvfill_patch.link import loads_every_group

    return loads_every_group()


@pytest.fixture
def node_for(vllm_config_for, hybrid):
    with opt_ins_forgotten():
        yield lambda **options: Node(vllm_config_for(**options), hybrid)


def snapshot(node: Node) -> list[torch.Tensor]:
    return [pool.raw.clone() for pool in node.pools]


def test_a_request_waits_for_its_kv_and_runs_once_every_rank_reported(node_for):
    from vllm.v1.request import RequestStatus

    import vllm_kvfill_patch

    node = node_for(transfer_latency_ms=200)
    status = vllm_kvfill_patch.status()
    assert status.parts[-1] == "link"
    assert status.semantics.endswith(
        "; its KV over a modelled link (latency 200 ms, no bandwidth limit)"
    )
    assert status.semantics_why.endswith(
        "; transfer_latency_ms / transfer_gbps in the connector's options"
    )
    request = node.add("r")
    before = snapshot(node)
    admitted = node.step()
    assert dict(admitted.num_scheduled_tokens) == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = node.blocks("r")
    assert len(blocks) == 3  # 39 tokens to fill, 16 a block
    node.step(advance_ms=199)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert node.changed_pages(before) == [set(), set()]
    node.step(advance_ms=1)
    # Both ranks filled the request's blocks (its state's page too) and
    # nothing else, and reported it once.
    filled = set(blocks) | set(node.state_blocks("r"))
    assert node.changed_pages(before) == [filled, filled]
    assert node.reports[-1] == [{"r"}, {"r"}]
    delivered = node.step()
    assert dict(delivered.num_scheduled_tokens) == {"r": 1}
    assert request.num_computed_tokens == PROMPT_LEN
    for _ in range(3):
        node.step(advance_ms=10)
    assert [reports for reports in node.reports if any(reports)] == [[{"r"}, {"r"}]]


def test_a_transfer_is_reported_at_the_end_of_the_step_it_arrives_in(node_for):
    """As NIXL's worker starts a read from ``start_load_kv`` and reports it
    from the first ``get_finished`` that finds it done. The test's step calls
    ``start_load_kv`` before its forward pass (vLLM up to 0.28; later ones do
    so beside a synchronous load): with 5 ms of latency a 4 ms pass is too
    short, and a transfer that arrives during the admitting step's 10 ms pass
    is reported at that step's end."""
    node = node_for(transfer_latency_ms=5)
    node.add("r")
    node.step(forward_ms=4)
    assert node.reports[-1] == [set(), set()]
    node.step(forward_ms=1)
    assert node.reports[-1] == [{"r"}, {"r"}]
    assert dict(node.step().num_scheduled_tokens) == {"r": 1}
    node.add("s")
    admitting = node.step(forward_ms=10)
    assert "s" not in admitting.num_scheduled_tokens
    assert node.reports[-1] == [{"s"}, {"s"}]
    assert "s" in node.step().num_scheduled_tokens


def test_one_ranks_report_is_not_enough_for_vllms_aggregator(node_for):
    """vLLM counts a report per rank: with one rank withholding its report,
    the request stays waiting (what makes a report from every rank needed)."""
    from vllm.v1.request import RequestStatus

    node = node_for(transfer_latency_ms=0)
    request = node.add("r")
    withheld = node.ranks.pop()
    node.step()
    node.step()
    assert node.reports[0] == [{"r"}]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    node.ranks.append(withheld)


def test_transfers_share_one_link_first_come_first_served(node_for, hybrid):
    """Three requests admitted together, each 125 ms on the link (a time
    binary fractions hold exactly): the k-th arrives at k x 125 ms. A
    transfer's bytes are what a NIXL node reads: here 3 attention pages, and
    one state block's states without the padding of its page."""
    request_bytes = 3 * PAGE_BYTES + (STATE_BYTES if hybrid else 0)
    gbps = request_bytes * 8 / 0.125 / 1e9
    node = node_for(transfer_gbps=gbps)
    for request_id in "abc":
        node.add(request_id)
    node.step()
    assert node.link.bytes_of(([1, 2, 3], [4])[: 1 + hybrid]) == request_bytes
    arrivals = {}
    for tick in range(1, 100):
        node.step(advance_ms=5)
        for request_id in node.reports[-1][0]:
            arrivals[request_id] = tick * 5
    assert arrivals == {"a": 125, "b": 250, "c": 375}


def arrival_ticks(node: Node, ticks: int, added: dict[int, str]) -> dict[str, int]:
    """Steps 5 ms apart: the request of `added` added at its tick; when each
    rank 0 reported received, in ms."""
    arrivals = {}
    for tick in range(1, ticks):
        if tick * 5 in added:
            node.add(added[tick * 5])
        node.step(advance_ms=5)
        for request_id in node.reports[-1][0]:
            arrivals[request_id] = tick * 5
    return arrivals


def test_fairly_shared_transfers_admitted_together_arrive_together(node_for, hybrid):
    """Eight requests, each 125 ms on the link alone, share it: all arrive
    at 8 x 125 ms, where first come first served would space them."""
    request_bytes = 3 * PAGE_BYTES + (STATE_BYTES if hybrid else 0)
    gbps = request_bytes * 8 / 0.125 / 1e9
    node = node_for(transfer_gbps=gbps, transfer_sharing="fair")
    assert "shared fairly among the transfers on it" in str(node.link.model)
    for request_id in "abcdefgh":
        node.add(request_id)
    node.step()
    assert arrival_ticks(node, 250, {}) == dict.fromkeys("abcdefgh", 1000)


def test_a_fairly_shared_transfer_is_slowed_by_one_that_joins_it(node_for, hybrid):
    """a alone takes 250 ms; b joins at 125 ms, when a is half done: both
    then move at half the rate, a arrives at 375 ms (its workers told the new
    time in the step that admitted b), and b, alone again, at 500 ms."""
    request_bytes = 3 * PAGE_BYTES + (STATE_BYTES if hybrid else 0)
    node = node_for(
        transfer_gbps=request_bytes * 8 / 0.25 / 1e9, transfer_sharing="fair"
    )
    node.add("a")
    node.step()
    assert arrival_ticks(node, 150, {125: "b"}) == {"a": 375, "b": 500}


def test_a_request_aborted_in_flight_is_reported_and_its_blocks_freed(node_for):
    from vllm.v1.request import RequestStatus

    node = node_for(transfer_latency_ms=200)
    free = node.free_blocks()
    node.add("r")
    before = snapshot(node)
    node.step()
    assert node.free_blocks() < free
    node.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    node.step(advance_ms=10)
    assert node.reports[-1] == [{"r"}, {"r"}]
    assert node.free_blocks() == free
    assert "r" not in node.scheduler.requests
    node.step(advance_ms=500)  # its transfer's time passes: nothing written
    assert node.changed_pages(before) == [set(), set()]
    assert not any(any(reports) for reports in node.reports[2:])


def test_without_the_link_options_the_kv_arrives_in_the_admitting_step(node_for):
    import vllm_kvfill_patch

    node = node_for()
    request = node.add("r")
    before = snapshot(node)
    admitted = node.step()
    assert dict(admitted.num_scheduled_tokens) == {"r": 1}
    assert request.num_computed_tokens == PROMPT_LEN
    filled = set(node.blocks("r"))
    assert all(changed >= filled for changed in node.changed_pages(before))
    assert node.reports == [[set(), set()]] and node.link is None
    assert "link" not in vllm_kvfill_patch.status().parts


def test_where_vllm_loads_one_group_a_hybrid_models_link_is_an_error(
    vllm_config_for, hybrid
):
    """Up to 0.16 vLLM's scheduler finishes async loads of one KV-cache group
    only: a hybrid model's link options are refused, by name, at once."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        KVConnectorRole,
        decode_bench_connector,
    )

    def build():
        return decode_bench_connector.DecodeBenchConnector(
            vllm_config_for(transfer_latency_ms=5),
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(make_pool(NUM_BLOCKS)),
        )

    with opt_ins_forgotten():
        if hybrid:
            assert build().connector_scheduler._kvfill_link is not None
            return
        with pytest.raises(ValueError, match="this model has 2"):
            build()


BAD_LINK_OPTIONS = {
    "negative latency": ({"transfer_latency_ms": -1}, "must be at least 0"),
    "text latency": ({"transfer_latency_ms": "200"}, "must be a finite number"),
    "infinite latency": ({"transfer_latency_ms": float("inf")}, "a finite number"),
    "zero bandwidth": ({"transfer_gbps": 0}, "must be above 0"),
    "nan bandwidth": ({"transfer_gbps": float("nan")}, "must be a finite number"),
    "unknown sharing": (
        {"transfer_gbps": 1, "transfer_sharing": "fastest"},
        "'transfer_sharing' must be 'fifo' or 'fair', got 'fastest'",
    ),
    "beside a startup fill": (
        {"transfer_gbps": 100, "startup_fill": True},
        "'startup_fill' must be false where transfer_latency_ms",
    ),
}


@pytest.mark.parametrize("case", BAD_LINK_OPTIONS)
def test_a_bad_link_option_is_an_error_naming_it(case, vllm_config_for):
    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        KVConnectorRole,
        decode_bench_connector,
    )

    options, said = BAD_LINK_OPTIONS[case]
    pool = make_pool(NUM_BLOCKS)
    with pytest.raises(ValueError, match=re.escape(said)):
        decode_bench_connector.DecodeBenchConnector(
            vllm_config_for(**options),
            KVConnectorRole.SCHEDULER,
            make_kv_cache_config(pool),
        )


def test_revert_takes_the_link_out_down_to_upstreams_own_methods(node_for):
    """The wrapper of the inherited ``get_finished`` goes with the rest: the
    connector class is left without an attribute of its own there."""
    import wrapt
    from vllm.distributed.kv_transfer.kv_connector.v1 import decode_bench_connector

    import vllm_kvfill_patch

    node_for(transfer_latency_ms=5)
    connector = decode_bench_connector.DecodeBenchConnector
    assert "get_finished" in connector.__dict__
    inherited = connector.__mro__[1].get_finished
    vllm_kvfill_patch.revert()
    assert "get_finished" not in connector.__dict__
    assert connector.get_finished is inherited
    for name in ("get_num_new_matched_tokens", "build_connector_meta"):
        method = connector.__dict__[name]
        assert wrapt.unwrapped(method) is method
    assert vllm_kvfill_patch.apply().parts[-1] == "link"


def test_a_transfer_carries_what_the_real_nixl_node_received():
    """The fidelity tool's model, as vLLM plans its cache: 2 attention layers
    (256-token blocks, one KV head of 64, bf16) and 6 gated-delta-net layers
    in 3 groups (conv state (3, 384) in bf16, recurrent (2, 64, 64) in
    float32, each page padded to the attention page). For a 512-token prompt
    the real NIXL node received 472,576 bytes (docs/benchmark.md): 2 blocks
    of each attention layer, each state without its padding."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from vllm_kvfill_patch.link import Link, LinkModel, bytes_per_block

    attention = FullAttentionSpec(
        block_size=256, num_kv_heads=1, head_size=64, dtype=torch.bfloat16
    )
    states = MambaSpec(
        block_size=256,
        shapes=((3, 384), (2, 64, 64)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=attention.page_size_bytes,
    )
    groups = [KVCacheGroupSpec(["l3", "l7"], attention)] + [
        KVCacheGroupSpec([f"l{i}", f"l{i + 4}"], states) for i in range(3)
    ]
    config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    link = Link(LinkModel(), bytes_per_block(config))
    assert link.bytes_of(([1, 2], [3], [4], [5])) == 472_576


def test_every_worker_announces_its_link_and_the_bytes_it_reads(node_for):
    """Through vLLM's handshake channel, as NIXL's workers do: each rank's
    bytes per block of every group, from its own layers' specs."""
    from vllm_kvfill_patch.link_handshake import Announcement

    node = node_for(transfer_latency_ms=5)
    announced = [rank.get_handshake_metadata() for rank in node.ranks]
    assert all(isinstance(said, Announcement) for said in announced)
    assert {said.bytes_per_block for said in announced} == {node.link.bytes_per_block}
    hand_over(node.scheduler.connector, {(0, 0): announced[0]})
    assert node_for().ranks[0].get_handshake_metadata() is None  # no link: upstream's


def hand_over(connector, metadata: dict) -> str:
    """What vLLM's engine core does at startup with the workers' handshake
    metadata, keyed by (pp_rank, tp_rank): the PP-aware setter from 0.23,
    the other keyed by tensor rank before. How it names a worker."""
    if hasattr(connector, "set_xfer_handshake_metadata_pp_aware"):
        connector.set_xfer_handshake_metadata_pp_aware(metadata)
        return "worker (pp {}, tp {})"
    connector.set_xfer_handshake_metadata(
        {tp: said for (_, tp), said in metadata.items()}
    )
    return "worker (tp {1})"


def test_a_worker_that_did_not_announce_the_link_stops_the_engine(node_for):
    """With two tensor-parallel ranks, rank 1 silent: the scheduler side
    refuses at startup, naming the option, the worker and why."""
    node = node_for(transfer_latency_ms=5)
    connector = node.scheduler.connector
    connector._vllm_config.parallel_config.tensor_parallel_size = RANKS
    announced = node.ranks[0].get_handshake_metadata()
    with pytest.raises(RuntimeError) as refused:
        hand_over(connector, {(0, 0): announced})
    said = str(refused.value)
    named = hand_over(connector, {(0, tp): announced for tp in range(RANKS)})
    assert "'transfer_latency_ms'" in said and named.format(0, 1) in said
    assert "KVFILL_PATCH_DISABLE=1" in said and "wait for its KV for ever" in said


@pytest.fixture
def fails_by_request() -> bool:
    from vllm_kvfill_patch.options import fails_by_request

    return fails_by_request()


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_transfer_is_a_failed_load_for_vllms_policy(
    policy, vllm_config_for, hybrid, fails_by_request
):
    """Nothing is written; every rank reports the request finished and its
    load failed in one step; vLLM's ``kv_load_failure_policy`` does the rest:
    ``recompute`` computes the whole prompt locally, ``fail`` ends the
    request with an error and frees its blocks. (Up to 0.31 vLLM takes a
    failed load by its blocks, of one KV-cache group: the attention group
    alone there.)"""
    from vllm.config import KVTransferConfig
    from vllm.v1.request import RequestStatus

    has_policy = "kv_load_failure_policy" in str(inspect.signature(KVTransferConfig))
    if policy == "fail" and not has_policy:
        pytest.skip(
            "vLLM 0.11 - 0.12 have no kv_load_failure_policy: a failed load is "
            "always recomputed there"
        )
    with opt_ins_forgotten():
        node = Node(
            vllm_config_for(transfer_latency_ms=10, transfer_failure_rate=1.0),
            hybrid and fails_by_request,
            policy,
        )
        free = node.free_blocks()
        request = node.add("r")
        before = snapshot(node)
        node.step()
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        node.step(advance_ms=10)
        assert node.reports[-1] == [{"r"}, {"r"}]
        assert node.changed_pages(before) == [set(), set()]
        if policy == "fail":
            assert request.status == RequestStatus.FINISHED_ERROR
            assert node.free_blocks() == free
            assert "r" not in node.scheduler.requests
            return
        recomputed = node.step()
        assert dict(recomputed.num_scheduled_tokens) == {"r": PROMPT_LEN}
        assert request.num_computed_tokens == PROMPT_LEN


def failed_transfers(vllm_config, transfers: int) -> list[str]:
    """The ids of `transfers` transfers the scheduler side fails."""
    from tests.hybrid import scheduler_connector

    link = scheduler_connector(vllm_config, [BLOCK_SIZE]).connector_scheduler
    started = link._kvfill_link.admit(
        {f"r{k}": (([1],), BLOCK_SIZE) for k in range(transfers)}
    )
    return [rid for rid, transfer in started.items() if transfer.failed]


def test_the_failures_follow_the_rate_and_vllms_seed(vllm_config_for):
    """400 transfers at 0.5: the count inside the binomial's 99.99% range
    (200 +- 3.9 sd); the same transfers fail for the same seed, others for
    another."""
    config = vllm_config_for(transfer_latency_ms=5, transfer_failure_rate=0.5)
    with opt_ins_forgotten():
        failed = failed_transfers(config, 400)
        assert 161 <= len(failed) <= 239
        assert failed_transfers(copy.deepcopy(config), 400) == failed
        reseeded = copy.deepcopy(config)
        reseeded.model_config.seed = 1234
        assert failed_transfers(reseeded, 400) != failed


def test_the_links_transfers_reach_vllms_metrics(node_for, hybrid):
    """Each rank's stats (bytes on its rank, seconds from admission to its
    report, failures), aggregated by vLLM's aggregator (two requests on two
    ranks: four reads, as NIXL counts them), built back by the class method
    vLLM's stat logger calls, and recorded under the emulated names."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from vllm_kvfill_patch.link_stats import LinkStats

    node = node_for(transfer_latency_ms=20)
    for request_id in "ab":
        node.add(request_id)
    for _ in range(4):
        node.step(advance_ms=10)
    assert len(node.stats) == 1 and isinstance(node.stats[0], LinkStats)
    connector_cls = type(node.ranks[0])
    rebuilt = connector_cls.build_kv_connector_stats(dict(node.stats[0].data))
    request_bytes = node.link.bytes_of(([1, 2, 3], [4])[: 1 + hybrid])
    assert rebuilt.reduce() == {
        "Emulated transfers": 4,
        "Emulated failed transfers": 0,
        "Emulated avg xfer time (ms)": 20.0,
        "Emulated max xfer time (ms)": 20.0,
        "Emulated MB transferred": round(4 * request_bytes / 2**20, 3),
    }
    registry = CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry)
        for kind in (Counter, Gauge, Histogram)
    }
    prom = connector_cls.build_prom_metrics(
        node.scheduler.connector._vllm_config, types, ["engine"], {0: ["0"]}
    )
    prom.observe(rebuilt.to_dict(), 0)
    read = registry.get_sample_value
    assert read("vllm:emulated_kv_xfer_time_seconds_count", {"engine": "0"}) == 4
    assert read("vllm:emulated_kv_bytes_transferred_sum", {"engine": "0"}) == (
        4 * request_bytes
    )


def test_revert_with_a_transfer_in_flight_still_reports_it(node_for):
    """revert() in the process of a worker holding a transfer: the link's
    reports stay until it is reported (the status says so), the request is
    scheduled as before, and a later revert() takes them out too."""
    import vllm_kvfill_patch

    node = node_for(transfer_latency_ms=200)
    request = node.add("r")
    node.step()
    reverted = vllm_kvfill_patch.revert()
    assert reverted.decision.value == "reverted"
    assert "the link's reports stay until the 2 transfers in flight" in reverted.reason
    node.step(advance_ms=200)
    assert node.reports[-1] == [{"r"}, {"r"}]
    assert dict(node.step().num_scheduled_tokens) == {"r": 1}
    assert request.num_computed_tokens == PROMPT_LEN
    connector = type(node.ranks[0])
    assert "get_finished" in connector.__dict__  # in place, passing calls through
    assert "transfers in flight" not in vllm_kvfill_patch.revert().reason
    assert "get_finished" not in connector.__dict__
    assert vllm_kvfill_patch.apply().parts[-1] == "link"


def test_a_silent_stage_stops_the_engine_where_vllm_keys_workers_by_stage(node_for):
    """Pipeline parallel 2, stage 1's worker silent: refused from 0.23, whose
    engine core keys the workers by (pp, tp); up to 0.22 vLLM merges the two
    stages' keys (tp alone), and stage 0's announcement hides it."""
    node = node_for(transfer_latency_ms=5)
    connector = node.scheduler.connector
    connector._vllm_config.parallel_config.pipeline_parallel_size = 2
    announced = {(0, 0): node.ranks[0].get_handshake_metadata()}
    if not hasattr(connector, "set_xfer_handshake_metadata_pp_aware"):
        hand_over(connector, announced)
        return
    with pytest.raises(RuntimeError, match=re.escape("worker (pp 1, tp 0)")):
        hand_over(connector, announced)


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_a_transfer_carries_the_prompt_tokens_nixl_reads(
    model, vllm_config_for, hybrid
):
    """NIXL reads all of a prompt but the last ``_prefill_backoff()`` tokens:
    none without Mamba states, so a dense model's 33-token prompt is 3 blocks
    of 16 where upstream fills 32 tokens (2 blocks); with states, the last is
    left to decode as upstream does (2 blocks and the states). A 40-token
    prompt is 3 blocks either way."""
    from vllm_kvfill_patch.link import TRANSFERS_ATTR

    if model == "hybrid" and not hybrid:
        pytest.skip(
            "vLLM 0.11.1 - 0.16 load one KV-cache group asynchronously: the link "
            "refuses a hybrid model there (the dense case runs)"
        )
    states = STATE_BYTES if model == "hybrid" else 0
    with opt_ins_forgotten():
        node = Node(vllm_config_for(transfer_latency_ms=5), model == "hybrid")
        node.add("r", prompt_len=33)
        node.add("s", prompt_len=40)
        admitted = node.step()
    transfers = getattr(admitted.kv_connector_metadata, TRANSFERS_ATTR)
    assert {rid: transfer.nbytes for rid, transfer in transfers.items()} == {
        "r": (3 if model == "dense" else 2) * PAGE_BYTES + states,
        "s": 3 * PAGE_BYTES + states,
    }
    assert [len(ids) for ids in transfers["r"].fill[0]][0] == 2


def test_the_status_holds_the_refill_and_the_link_as_fields(node_for):
    """Both opt-ins at once: the refill before the link among the parts, the
    link model a field of the status, and the link's going leaves the
    refill's semantics as they were (nothing read back out of a sentence)."""
    from vllm_kvfill_patch import installer

    node_for(transfer_latency_ms=5, refill_preempted=True)
    status = installer.status()
    assert status.parts[-2:] == ("refill", "link")
    assert status.link is not None and status.link.latency_ms == 5
    assert status.semantics.startswith("a decode node with an offload tier")
    assert status.semantics.endswith(f"its KV over a modelled link ({status.link})")
    installer.link_opted_out()
    status = installer.status()
    assert status.parts[-1] == "refill" and status.link is None
    assert status.semantics == status.preemption
    assert status.semantics_why == "refill_preempted in the connector's options"
