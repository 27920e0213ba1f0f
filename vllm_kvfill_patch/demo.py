"""Decode benchmark of a tiny hybrid model through DecodeBenchConnector, on CPU.

    python -m vllm_kvfill_patch.demo [--no-overlay]

A config-only Qwen3-Next (one linear-attention layer, one full-attention
layer) with dummy weights runs in an in-process vLLM engine; the connector
fills the prompt's KV cache and state instead of prefill, and the demo times
decoding at a few context lengths. `--no-overlay` sets the kill switch and
shows what upstream does instead (on vLLM <= 0.23: the crash, in one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
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

CONTEXT_LENGTHS = (64, 128, 200)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-overlay", action="store_true", help="upstream's fill only"
    )
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    if args.no_overlay:
        from vllm_kvfill_patch import KILL_SWITCH

        os.environ[KILL_SWITCH] = "1"
    # In process, so the worker's failure surfaces here as one exception.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import vllm
    from vllm import LLM, SamplingParams

    import vllm_kvfill_patch

    vllm_kvfill_patch.apply()
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = write_tiny_model(Path(scratch) / "tiny-qwen3-next")
        print(f"vLLM {vllm.__version__}: starting an engine on a tiny Qwen3-Next ...")
        llm = LLM(**engine_arguments(model_dir, distributed_executor_backend="uni"))
        status = vllm_kvfill_patch.status()
        print(f"patch: {status.decision.value} ({status.reason})")
        sampling = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True)
        print(f"{'context':>8} {'batch':>6} {'decode tok/s':>13}")
        try:
            # Warm-up: the first steps of a fresh engine are slower.
            llm.generate(prompts(16, 1), sampling, use_tqdm=False)
            for context_length in CONTEXT_LENGTHS:
                start = time.perf_counter()
                outputs = llm.generate(
                    prompts(context_length, args.batch), sampling, use_tqdm=False
                )
                elapsed = time.perf_counter() - start
                decoded = sum(len(o.outputs[0].token_ids) for o in outputs)
                print(f"{context_length:>8} {args.batch:>6} {decoded / elapsed:>13.1f}")
        except Exception as exc:  # noqa: BLE001 - reported in one line
            root: BaseException = exc
            while root.__cause__ is not None:
                root = root.__cause__
            print(f"DecodeBenchConnector failed: {type(root).__name__}: {root}")
            return 0 if args.no_overlay else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
