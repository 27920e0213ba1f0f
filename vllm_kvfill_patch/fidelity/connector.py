"""The connector the fidelity tool serves: DecodeBenchConnector whose
worker's write can be switched off, in place, between legs (`switch`).

Loaded by vLLM itself, through ``kv_connector_module_path``
(`modes.SWITCHED_CONNECTOR`). Written on, it is DecodeBenchConnector as
released or as this package patches it, whichever is in force; written off,
it is the ideal: the same scheduler side, so requests are admitted and
preempted requests recomputed alike, and a fill that costs nothing. The KV
cache then holds whatever the blocks held before, which is what decode
computes on.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
    DecodeBenchConnector,
)

from vllm_kvfill_patch.fidelity import switch


class SwitchedDecodeBenchConnector(DecodeBenchConnector):
    """DecodeBenchConnector whose write `switch` turns on and off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        switch.register(self)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not switch.writes():
            return None
        return super().start_load_kv(forward_context, **kwargs)
