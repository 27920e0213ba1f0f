"""The step both tools time: one scheduler step of a 48-layer hybrid model.

A Qwen3-Next-like mix: 12 attention layers and 36 linear-attention layers in
three groups of 12, as vLLM's hybrid allocator groups them. Per request a
128-token prompt in 8 attention blocks and one state block per linear group,
the blocks handed out interleaved between requests, as the allocator does.
The caches: every group over one int8 backing buffer, layer-outer (each
layer slot one region of pages), the attention group split into 2 kernel
blocks per block, the linear groups' layers int8 pages, as vLLM 0.33's
allocator lays them out (``tools/bench.py`` also takes them from vLLM's own
allocator). What a step must write: each requested block's rows in every
layer of its group, exactly the bytes a memset of the limit writes.

PyTorch alone, neither vLLM nor the package (``tools/gpu_check.py`` runs it
on a bare GPU machine): the tools build their workers over it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LAYERS_PER_GROUP, LINEAR_GROUPS = 12, 3
GROUPS = 1 + LINEAR_GROUPS
"""One attention group and three linear-attention groups of 12 layers."""
ATTENTION_BLOCKS, STATE_BLOCKS = 8, 1
"""Per request: a 128-token prompt in 16-token attention blocks; one state
block per linear group (prefix caching off)."""
BLOCK_TOKENS = 16
PROMPT_TOKENS = ATTENTION_BLOCKS * BLOCK_TOKENS
KERNEL_SPLIT = 2
"""The attention group's 16-token blocks run as 8-token kernel blocks (as
FlashInfer or FlashMLA split a hybrid model's raised block size)."""
UNWRITTEN = 0x55
"""The byte a step's buffer holds before the step."""


def step_blocks(requests: int) -> int:
    """Blocks of a step's pool: every request's, and the null block."""
    per_request = ATTENTION_BLOCKS + LINEAR_GROUPS * STATE_BLOCKS
    return 1 + requests * per_request


def step_requests(requests: int, num_blocks: int) -> dict:
    """The step's metadata ``{req_id: (block_ids_per_group, num_tokens)}``, the
    blocks handed out as the allocator does: interleaved between requests."""
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0))
    free = (order + 1).tolist()
    per_group = [ATTENTION_BLOCKS] + [STATE_BLOCKS] * LINEAR_GROUPS
    return {
        f"r{r}": ([[free.pop() for _ in range(n)] for n in per_group], PROMPT_TOKENS)
        for r in range(requests)
    }


def layer_names(group: int) -> list[str]:
    """The group's layers, named as vLLM names a hybrid's layers."""
    kind = "attn" if group == 0 else f"linear{group}"
    return [f"layers.{slot}.{kind}" for slot in range(LAYERS_PER_GROUP)]


@dataclass
class Step:
    """One scheduler step of `count` requests over a hybrid's caches:
    `kv_caches` (views of one int8 `buffer`) in `group_to_layers`, pools of
    ``step_blocks(count)`` blocks, and what the step must write."""

    kv_caches: dict[str, torch.Tensor]
    group_to_layers: dict[int, list[str]]
    count: int
    num_blocks: int = field(init=False)
    requests: dict = field(init=False)
    buffer: torch.Tensor = field(init=False)
    written_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_blocks = step_blocks(self.count)
        self.requests = step_requests(self.count, self.num_blocks)
        first = next(iter(self.kv_caches.values()))
        self.buffer = torch.empty(0, dtype=torch.int8, device=first.device)
        self.buffer.set_(first.untyped_storage())
        self.written_bytes = sum(
            len(ids) * self.written_per_block(group)
            for group, ids in self.block_ids.items()
        )

    @property
    def block_ids(self) -> dict[int, list[int]]:
        """Each group's requested blocks, the step's union."""
        return {
            group: [b for ids, _ in self.requests.values() for b in ids[group]]
            for group in self.group_to_layers
        }

    def written_per_block(self, group: int) -> int:
        """The bytes of one block in every layer of `group`: its rows (its
        kernel rows, where split), as each layer's view covers them (vLLM
        0.29+'s views cover a Mamba page's state bytes, not its padding)."""
        total = 0
        for name in self.group_to_layers[group]:
            cache = self.kv_caches[name]
            total += cache.shape[0] // self.num_blocks * cache[0].nbytes
        return total

    def memset(self) -> None:
        """A memset of as many bytes as the step writes, contiguous, in the
        caches' own buffer: the limit of any fill of them."""
        self.buffer[: self.written_bytes].fill_(1)

    def layer_pages(self) -> torch.Tensor:
        """The buffer as ``(layer slot, block, page)`` bytes."""
        return self.buffer.view(LAYERS_PER_GROUP, self.num_blocks, -1)


def hybrid_step(device: torch.device, requests: int, page_bytes: int) -> Step:
    """The step over caches laid out as vLLM 0.33's allocator lays them out,
    built without vLLM: `page_bytes` a page, every byte `UNWRITTEN`."""
    num_blocks = step_blocks(requests)
    size = LAYERS_PER_GROUP * num_blocks * page_bytes
    buffer = torch.full((size,), UNWRITTEN, dtype=torch.int8, device=device)
    kv_caches: dict[str, torch.Tensor] = {}
    for group in range(GROUPS):
        dtype, ratio = (torch.bfloat16, KERNEL_SPLIT) if group == 0 else (torch.int8, 1)
        views = group_views(buffer, num_blocks, page_bytes, dtype, ratio)
        kv_caches.update(zip(layer_names(group), views, strict=True))
    group_to_layers = {group: layer_names(group) for group in range(GROUPS)}
    return Step(kv_caches, group_to_layers, requests)


def group_views(
    buffer: torch.Tensor,
    num_blocks: int,
    page_bytes: int,
    dtype: torch.dtype,
    ratio: int,
) -> list[torch.Tensor]:
    """A group's 12 layer-outer views ``[B * ratio, H, N, C]`` of `dtype` over
    `buffer` (each layer slot its own region of `num_blocks` dense pages,
    tokens outside heads within a page)."""
    elements = page_bytes // dtype.itemsize
    heads, content = 2, 64
    tokens = elements // (heads * content * ratio)
    assert tokens * heads * content * ratio == elements, page_bytes
    shape = (num_blocks * ratio, heads, tokens, content)
    strides = (elements // ratio, content, heads * content, 1)
    return [
        view_at(buffer, dtype, shape, strides, slot * num_blocks * page_bytes)
        for slot in range(LAYERS_PER_GROUP)
    ]


def view_at(
    buffer: torch.Tensor, dtype: torch.dtype, shape: tuple, strides: tuple, at: int
) -> torch.Tensor:
    """A `dtype` view of `buffer` (int8) at byte `at`, strides in elements."""
    assert at % dtype.itemsize == 0, at
    return torch.as_strided(buffer.view(dtype), shape, strides, at // dtype.itemsize)
