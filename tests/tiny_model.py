"""The tiny hybrid model the engine and connector tests run: a config-only
Qwen3-Next (one linear-attention layer, one full-attention layer) served with
dummy weights, and how an in-process engine is built on it. Imports neither
vLLM nor this package: some scenarios import the package only after the
engine is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""Hidden 128, two layers; head_dim 64 because CPU attention rejects 16."""

DECODE_BENCH_CONNECTOR = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"}


def write_tiny_model(directory: Path) -> Path:
    """A model directory holding only config.json (load it with load_format=dummy)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT, indent=2))
    return directory


def engine_arguments(model_dir: Path, **overrides: Any) -> dict:
    """`LLM(...)` arguments for the tiny model with DecodeBenchConnector."""
    return {
        "model": str(model_dir),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "max_model_len": 256,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "mamba_ssm_cache_dtype": "float32",
        "kv_cache_memory_bytes": 64 * 1024 * 1024,
        "kv_transfer_config": DECODE_BENCH_CONNECTOR,
        **overrides,
    }


def prompts(context_length: int, batch: int) -> list[dict]:
    return [
        {"prompt_token_ids": [(seed + i) % 500 + 1 for i in range(context_length)]}
        for seed in range(batch)
    ]
