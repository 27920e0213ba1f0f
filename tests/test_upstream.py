"""What upstream's own connector gets wrong on the releases where the patch is
inert today (0.30+), shown on the real connector with the overlay out.

Each test asserts upstream's defect as it is: when a release fixes it, the
test fails, and the support policy (releases.py) should say so.
"""

from __future__ import annotations

import pytest
import torch

import vllm_kvfill_patch
from tests.hybrid import ATTENTION_LAYER, PAGE_BYTES, make_pool, make_worker_connector
from tests.hybrid import start_fill as fill
from vllm_kvfill_patch import Decision

NUM_BLOCKS = 12


@pytest.fixture(autouse=True)
def upstream_only(vllm_config_for):
    vllm_config_for()  # loads vLLM's plugins, this package's among them
    assert vllm_kvfill_patch.status().decision in (Decision.INERT, Decision.PENDING)


@pytest.mark.parametrize("ratio", [2, 4])
def test_upstream_fills_kernel_row_b_of_a_kernel_split_cache(vllm_config_for, ratio):
    pool = make_pool(NUM_BLOCKS, kernel_split=ratio)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    attention = pool.caches[ATTENTION_LAYER]
    before = attention.clone()
    fill(connector, {"r": (([3], []), 16)})
    changed = {
        row
        for row in range(NUM_BLOCKS * ratio)
        if not torch.equal(
            attention[row].view(torch.int16), before[row].view(torch.int16)
        )
    }
    # Block 3 is kernel rows 3r .. 3r + r - 1; upstream writes kernel row 3,
    # a piece of block 3 // r, and leaves block 3 as it was.
    assert changed == {3}
    assert (attention[3] == 0.5).all()


def test_upstream_fills_list_state_tensors_whole(vllm_config_for):
    pool = make_pool(NUM_BLOCKS)
    connector = make_worker_connector(vllm_config_for(fill_mean=0.5), pool)
    before = pool.raw.clone().view(NUM_BLOCKS, PAGE_BYTES)
    fill(connector, {"r": (([], [5]), 16)})
    pages = pool.pages()
    changed = {b for b in range(NUM_BLOCKS) if not torch.equal(pages[b], before[b])}
    # One request's state block is 5; every block's state is overwritten.
    assert changed == set(range(NUM_BLOCKS))
