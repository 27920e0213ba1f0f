"""The forward patch (0.33) keeps upstream's own behaviours: fp8 caches,
zero-filled circular-buffer groups, startup fill.

Differential: the release's real connector and the patched file, loaded side
by side, fill identical caches; every byte must come out the same. Run in
the sessions of releases that have these behaviours (see noxfile.py).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import pytest
import torch

from tests.hybrid import BLOCK_SIZE, HEAD_DIM, HEADS, kv_cache_tensor, start_fill
from vllm_kvfill_patch.gating import CONNECTOR_MODULE

NUM_BLOCKS = 10
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")


@pytest.fixture(scope="module")
def implementations(patched_connector) -> dict:
    """{"upstream": the release's module, "patched": the patched file's}."""
    spec = importlib.util.spec_from_file_location(
        "kvfill_patched_decode_bench_connector", patched_connector
    )
    patched = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = patched
    spec.loader.exec_module(patched)
    return {"upstream": importlib.import_module(CONNECTOR_MODULE), "patched": patched}


def attention_config(spec_classes, dtype, **fields):
    """Two attention layers in two groups of the given spec classes."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    page = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * dtype.itemsize
    groups = [
        KVCacheGroupSpec(
            [layer],
            spec_class(
                block_size=BLOCK_SIZE,
                num_kv_heads=HEADS,
                head_size=HEAD_DIM,
                dtype=dtype,
                **fields,
            ),
        )
        for layer, spec_class in zip(LAYERS, spec_classes, strict=True)
    ]
    tensors = [
        kv_cache_tensor(KVCacheTensor, NUM_BLOCKS, page, layer) for layer in LAYERS
    ]
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def run(module, vllm_config, kv_cache_config, dtype, reqs_to_fill) -> dict:
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    generator = torch.Generator().manual_seed(0)
    caches = {
        layer: torch.randint(
            0, 100, (NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM), generator=generator
        ).to(dtype)
        for layer in LAYERS
    }
    connector = module.DecodeBenchConnector(
        vllm_config, KVConnectorRole.WORKER, kv_cache_config
    )
    connector.register_kv_caches(caches)
    start_fill(connector, reqs_to_fill)
    return caches


def assert_same_bytes(implementations, *args) -> dict:
    upstream = run(implementations["upstream"], *args)
    patched = run(implementations["patched"], *args)
    for layer in LAYERS:
        assert torch.equal(
            upstream[layer].view(torch.uint8), patched[layer].view(torch.uint8)
        ), layer
    return patched


def test_fp8_cache_is_filled_as_upstream_fills_it(implementations, vllm_config_for):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode

    config = vllm_config_for(fill_mean=0.5)
    kv_cache_config = attention_config(
        (FullAttentionSpec, FullAttentionSpec),
        torch.uint8,
        kv_quant_mode=KVQuantMode.FP8_PER_TENSOR,
    )
    original = config.cache_config.cache_dtype
    config.cache_config.cache_dtype = "fp8_e4m3"
    try:
        caches = assert_same_bytes(
            implementations,
            config,
            kv_cache_config,
            torch.uint8,
            {"r": (([2, 3], [4]), 32)},
        )
    finally:
        config.cache_config.cache_dtype = original
    fp8_half = torch.tensor(0.5).to(torch.float8_e4m3fn).view(torch.uint8)
    assert (caches[LAYERS[0]][[2, 3]] == fp8_half).all()


def test_circular_buffer_group_is_zero_filled_as_upstream(
    implementations, vllm_config_for
):
    from vllm.v1.kv_cache_interface import CircularBufferSpec, FullAttentionSpec

    kv_cache_config = attention_config(
        (FullAttentionSpec, CircularBufferSpec), torch.bfloat16
    )
    caches = assert_same_bytes(
        implementations,
        vllm_config_for(fill_mean=0.5),
        kv_cache_config,
        torch.bfloat16,
        {"r": (([2], [5]), 16)},
    )
    assert (caches[LAYERS[0]][2] == 0.5).all()
    assert not caches[LAYERS[1]][5].any()


def test_startup_fill_is_kept(implementations, vllm_config_for):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    kv_cache_config = attention_config(
        (FullAttentionSpec, FullAttentionSpec), torch.bfloat16
    )
    caches = assert_same_bytes(
        implementations,
        vllm_config_for(fill_mean=0.5, startup_fill=True),
        kv_cache_config,
        torch.bfloat16,
        {},
    )
    # Startup fill writes every block of every layer before any request.
    assert all((cache == 0.5).all() for cache in caches.values())
