"""The tiny hybrid model the engine and connector tests run: a config-only
Qwen3-Next (one linear-attention layer, one full-attention layer) served with
dummy weights, and how an in-process engine is built on it. Imports neither
vLLM nor this package: some scenarios import the package only after the
engine is built."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any


def _fidelity_model() -> ModuleType:
    """The fidelity tool's embedded model, from its file: importing it as a
    submodule would import the package."""
    path = Path(__file__).parents[1] / "vllm_kvfill_patch" / "fidelity" / "model.py"
    spec = importlib.util.spec_from_file_location("kvfill_fidelity_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY_QWEN3_NEXT = {
    **_fidelity_model().TINY_HYBRID_MOE,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "full_attention_interval": 2,
    "num_experts": 2,
    "num_experts_per_tok": 1,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
"""The fidelity tool's model cut to two layers (one of each kind) and two
experts, one per token."""

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
