"""Real vLLM objects for connector-level tests: config, KV-cache config, pools.

The pools are laid out the way vLLM's hybrid allocator lays them out: one raw
byte tensor per pool with a uniform page size, an attention layer viewing it
as ``(num_blocks, 2, block_size, heads, head_dim)`` (or FlashAttention's
``(2, num_blocks, ...)`` of vLLM <= 0.22), and each Mamba state an
``as_strided`` view ``(num_blocks, *state_shape)`` over the same pages.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.tiny_model import DECODE_BENCH_CONNECTOR

ATTENTION_LAYER = "model.layers.1.self_attn.attn"
LINEAR_LAYER = "model.layers.0.linear_attn"
ATTENTION_GROUP, LINEAR_GROUP = 0, 1

BLOCK_SIZE, HEADS, HEAD_DIM = 16, 1, 64
ATTENTION_DTYPE = torch.bfloat16
STATE_DTYPE = torch.float32
PAGE_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * ATTENTION_DTYPE.itemsize

GDN_STATES = ((3, 64), (2, 8, 8))
"""Qwen3-Next gated delta net: conv state, recurrent state."""
KDA_STATES = ((3, 32), (3, 32), (3, 32), (2, 8, 8))
"""Kimi-Linear KDA: q/k/v conv states, recurrent state."""
PROMPT_LEN = 40


def make_vllm_config(model_dir: Path, **extra_config):
    """A real VllmConfig selecting DecodeBenchConnector."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(
        **DECODE_BENCH_CONNECTOR, kv_connector_extra_config=extra_config
    )
    return EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,
        load_format="dummy",
        max_model_len=256,
        kv_transfer_config=transfer,
    ).create_engine_config()


@dataclass
class HybridPool:
    """One shared pool: an attention layer and a Mamba layer over the same pages."""

    raw: torch.Tensor
    num_blocks: int
    caches: dict
    state_shapes: tuple

    def pages(self) -> torch.Tensor:
        return self.raw.view(self.num_blocks, PAGE_BYTES)

    def attention_block(self, block_id: int) -> torch.Tensor:
        return self.pages()[block_id].view(ATTENTION_DTYPE)

    def state_block(self, block_id: int) -> list[torch.Tensor]:
        return [state[block_id] for state in self.caches[LINEAR_LAYER]]


def make_pool(
    num_blocks: int,
    state_shapes: tuple = GDN_STATES,
    states_as: type = list,
    kv_first: bool = False,
    kernel_split: int = 1,
) -> HybridPool:
    """`kernel_split` r: the attention view as the model runner builds it when
    the backend cannot run BLOCK_SIZE: N * r kernel blocks of BLOCK_SIZE / r
    tokens, manager block b = kernel rows b*r .. b*r + r - 1."""
    # Random bytes: an untouched row is recognisable byte for byte.
    raw = torch.randint(0, 256, (num_blocks * PAGE_BYTES,), dtype=torch.uint8)
    kernel_blocks, kernel_tokens = num_blocks * kernel_split, BLOCK_SIZE // kernel_split
    # FlashAttention <= 0.22.1 stacks K and V first: (2, num_blocks, ...).
    leading = (2, kernel_blocks) if kv_first else (kernel_blocks, 2)
    attention = raw.view(ATTENTION_DTYPE).view(*leading, kernel_tokens, HEADS, HEAD_DIM)
    states, offset = [], 0
    page_elements = PAGE_BYTES // STATE_DTYPE.itemsize
    for shape in state_shapes:
        inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        states.append(
            torch.as_strided(
                raw.view(STATE_DTYPE),
                (num_blocks, *shape),
                (page_elements, *inner),
                offset,
            )
        )
        offset += math.prod(shape)
    caches = {ATTENTION_LAYER: attention, LINEAR_LAYER: states_as(states)}
    return HybridPool(raw, num_blocks, caches, state_shapes)


def make_kv_cache_config(pool: HybridPool, fp8_attention: bool = False):
    """The real KVCacheConfig vLLM would build for this pool: two groups.

    With `fp8_attention`, the attention spec is the one vLLM builds for an
    fp8 KV cache: uint8 storage (and, where the release has it, per-tensor
    fp8 quantisation mode).
    """
    from vllm.v1 import kv_cache_interface
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )

    fp8_fields = {}
    if fp8_attention and hasattr(kv_cache_interface, "KVQuantMode"):
        fp8_fields["kv_quant_mode"] = kv_cache_interface.KVQuantMode.FP8_PER_TENSOR
    attention_spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=HEADS,
        head_size=HEAD_DIM,
        dtype=torch.uint8 if fp8_attention else ATTENTION_DTYPE,
        **fp8_fields,
    )
    mamba_spec = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=pool.state_shapes,
        dtypes=tuple(STATE_DTYPE for _ in pool.state_shapes),
        page_size_padded=PAGE_BYTES,
    )
    return KVCacheConfig(
        num_blocks=pool.num_blocks,
        kv_cache_tensors=[
            kv_cache_tensor(KVCacheTensor, pool.num_blocks, PAGE_BYTES, layer)
            for layer in (ATTENTION_LAYER, LINEAR_LAYER)
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([ATTENTION_LAYER], attention_spec),
            KVCacheGroupSpec([LINEAR_LAYER], mamba_spec),
        ],
    )


def kv_cache_tensor(tensor_class, num_blocks: int, page_bytes: int, layer: str):
    """One layer's placement in a pool of `num_blocks` pages, in the release's terms.

    Up to 0.28 a KVCacheTensor names the layers sharing a raw tensor; from
    0.29 it places same-shaped layers by strides, and layers of different
    groups overlay the same pages through tensors with overlapping ranges.
    """
    size = num_blocks * page_bytes
    if "shared_by" in {field.name for field in dataclasses.fields(tensor_class)}:
        return tensor_class(size=size, shared_by=[layer])
    return tensor_class(
        size=size, layers=[layer], layer_stride=size, block_stride=page_bytes
    )


def make_worker_connector(
    vllm_config, pool: HybridPool, kv_cache_config=None, module=None
):
    """A real worker-role DecodeBenchConnector with the pool's caches registered.

    `module`: the connector module to take it from (default: vLLM's own)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        KVConnectorRole,
        decode_bench_connector,
    )

    if kv_cache_config is None:
        kv_cache_config = make_kv_cache_config(pool)
    connector = (module or decode_bench_connector).DecodeBenchConnector(
        vllm_config, KVConnectorRole.WORKER, kv_cache_config
    )
    connector.register_kv_caches(pool.caches)
    return connector


def start_fill(connector, reqs_to_fill: dict) -> None:
    """Bind real metadata ``{req_id: (block_ids_per_group, num_tokens)}`` and fill."""
    # The connector's own module: a patched file loaded beside the original
    # has its own metadata class.
    module = sys.modules[type(connector).__module__]
    connector.bind_connector_metadata(
        module.DecodeBenchConnectorMetadata(reqs_to_fill=reqs_to_fill)
    )
    connector.start_load_kv(None)
    connector.clear_connector_metadata()


def make_request(request_id: str, prompt_len: int = PROMPT_LEN):
    """A real waiting ``Request`` of `prompt_len` prompt tokens."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    extra = {}
    if "eos_token_id" in inspect.signature(Request.__init__).parameters:
        extra["eos_token_id"] = None  # up to 0.22
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=64),
        pooling_params=None,
        **extra,
    )
    assert request.status == RequestStatus.WAITING
    return request


def scheduler_connector(config, block_sizes: list[int], num_blocks: int = 64):
    """A real scheduler-role DecodeBenchConnector over one attention group of
    each block size."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        KVConnectorRole,
        decode_bench_connector,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    tensors, groups = [], []
    for index, block_size in enumerate(block_sizes):
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=64,
            dtype=config.model_config.dtype,
        )
        layer = f"model.layers.{index + 1}.self_attn.attn"
        tensors.append(
            kv_cache_tensor(KVCacheTensor, num_blocks, spec.page_size_bytes, layer)
        )
        groups.append(KVCacheGroupSpec([layer], spec))
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )
    return decode_bench_connector.DecodeBenchConnector(
        config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
