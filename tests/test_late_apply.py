"""The patch fills right whenever it goes in.

A worker whose caches were registered before the patch was applied, or
registered again while it was reverted, is filled right at its next step;
while other threads toggle ``apply()``/``revert()`` and poll ``status()``,
every step is entirely the overlay's or entirely upstream's. The real
worker-role DecodeBenchConnector of the installed release, over one
kernel-split attention layer: upstream fills it without crashing, but at
other rows than the overlay, so the two are told apart byte for byte.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import vllm_kvfill_patch
from tests import hybrid
from tests.children import wrapper_count
from tests.helpers import overlay_reverted
from vllm_kvfill_patch import Decision

NUM_BLOCKS = 12
STEPS = (
    {"a": (([2],), 16), "b": (([5, 6],), 32)},
    {"c": (([9],), 16), "d": (([3, 10],), 32)},
)
"""Two steps of two requests each: a step half filled by each
implementation matches neither's bytes."""
MAX_RACING_STEPS = 2000


@pytest.fixture(scope="module")
def snapshot() -> torch.Tensor:
    """The pool's bytes before every step: random, so any write shows."""
    generator = torch.Generator().manual_seed(0)
    size = NUM_BLOCKS * hybrid.PAGE_BYTES
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)


@pytest.fixture
def config(vllm_config_for):
    assert vllm_kvfill_patch.apply().decision is Decision.APPLIED
    yield vllm_config_for(fill_mean=0.5)
    vllm_kvfill_patch.apply()


def attention_connector(config, snapshot: torch.Tensor):
    """A worker-role connector over one attention layer, split into 2 kernel
    rows per block, holding `snapshot`'s bytes; and the pool's raw bytes."""
    pool = hybrid.make_pool(NUM_BLOCKS, kernel_split=2)
    pool.raw.copy_(snapshot)
    del pool.caches[hybrid.LINEAR_LAYER]
    kv_cache_config = hybrid.make_kv_cache_config(pool)
    kv_cache_config.kv_cache_groups = kv_cache_config.kv_cache_groups[:1]
    kv_cache_config.kv_cache_tensors = kv_cache_config.kv_cache_tensors[:1]
    return hybrid.make_worker_connector(config, pool, kv_cache_config), pool.raw


@pytest.fixture
def expected(config, snapshot) -> dict[str, list[torch.Tensor]]:
    """Each step's bytes, from the snapshot, by the overlay and by upstream."""
    result = {}
    for name in ("overlay", "upstream"):
        reverted = (
            overlay_reverted() if name == "upstream" else contextlib.nullcontext()
        )
        with reverted:
            result[name] = []
            for step in STEPS:
                connector, raw = attention_connector(config, snapshot)
                hybrid.start_fill(connector, step)
                result[name].append(raw.clone())
    for overlay, upstream in zip(result["overlay"], result["upstream"], strict=True):
        assert not torch.equal(overlay, upstream)
        assert not torch.equal(overlay, snapshot)
    return result


def test_a_patch_applied_after_registration_fills_the_next_step_right(
    config, snapshot, expected
):
    vllm_kvfill_patch.revert()
    connector, raw = attention_connector(config, snapshot)
    assert vllm_kvfill_patch.apply().decision is Decision.APPLIED
    hybrid.start_fill(connector, STEPS[0])
    assert torch.equal(raw, expected["overlay"][0])


def test_revert_then_apply_fills_right_again_also_after_a_new_registration(
    config, snapshot, expected
):
    connector, raw = attention_connector(config, snapshot)
    hybrid.start_fill(connector, STEPS[0])
    assert torch.equal(raw, expected["overlay"][0])
    vllm_kvfill_patch.revert()
    raw.copy_(snapshot)
    hybrid.start_fill(connector, STEPS[0])
    assert torch.equal(raw, expected["upstream"][0])
    # Registered again while reverted: other tensors, the same connector.
    _, new_raw = other = attention_connector(config, snapshot)
    connector.register_kv_caches(other[0].connector_worker.kv_caches)
    raw.copy_(snapshot)
    assert vllm_kvfill_patch.apply().decision is Decision.APPLIED
    hybrid.start_fill(connector, STEPS[1])
    assert torch.equal(new_raw, expected["overlay"][1])
    assert torch.equal(raw, snapshot)  # the old registration is left alone


def test_steps_racing_apply_revert_and_status_are_each_one_implementation(
    config, snapshot, expected
):
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )

    done = threading.Event()
    errors: list[BaseException] = []
    outcomes: list[str] = []

    def guarded(body):
        def run():
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        return threading.Thread(target=run)

    def toggle():
        while not done.is_set():
            vllm_kvfill_patch.apply()
            vllm_kvfill_patch.revert()

    def poll():
        while not done.is_set():
            decision = vllm_kvfill_patch.status().decision
            assert decision in (Decision.APPLIED, Decision.REVERTED), decision

    def fill():
        # At least 40 steps, and on until this thread has seen a step of
        # each implementation: a race that never switched tests nothing.
        connector, raw = attention_connector(config, snapshot)
        seen: set[str] = set()
        for i in range(MAX_RACING_STEPS):
            if i >= 40 and {"overlay", "upstream"} <= seen:
                break
            raw.copy_(snapshot)
            hybrid.start_fill(connector, STEPS[i % 2])
            for name in ("overlay", "upstream"):
                if torch.equal(raw, expected[name][i % 2]):
                    outcomes.append(name)
                    seen.add(name)
                    break
            else:
                outcomes.append("neither")

    background = [guarded(toggle) for _ in range(2)] + [guarded(poll) for _ in range(2)]
    fillers = [guarded(fill) for _ in range(2)]
    for thread in background + fillers:
        thread.start()
    for thread in fillers:
        thread.join()
    done.set()
    for thread in background:
        thread.join()

    assert errors == []
    assert len(outcomes) >= 80 and "neither" not in outcomes
    assert {"overlay", "upstream"} <= set(outcomes)
    assert vllm_kvfill_patch.apply().decision is Decision.APPLIED
    assert wrapper_count(DecodeBenchConnector.__dict__["start_load_kv"]) == 1
    connector, raw = attention_connector(config, snapshot)
    hybrid.start_fill(connector, STEPS[0])
    assert torch.equal(raw, expected["overlay"][0])
