"""The ideal the fidelity tool measures against: a DecodeBenchConnector whose
worker writes nothing.

Loaded by vLLM itself, through ``kv_connector_module_path``:

    --kv-transfer-config '{"kv_connector": "NoWriteDecodeBenchConnector",
        "kv_connector_module_path": "vllm_kvfill_patch.fidelity.ideal",
        "kv_role": "kv_both"}'

The scheduler side is DecodeBenchConnector's own (with this package's
scheduler parts where they correct upstream), so requests are admitted, and
preempted requests recomputed, exactly as through the real connector; only
the write of dummy values is left out: a fill that costs nothing. The KV
cache then holds whatever the blocks held before, which is what decode
computes on.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnector,
)


class NoWriteDecodeBenchConnector(DecodeBenchConnector):
    """DecodeBenchConnector without the worker's write."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None
