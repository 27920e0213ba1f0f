"""The fidelity tool: vLLM's own ``vllm bench serve`` against ``vllm serve``
through DecodeBenchConnector, each mode against a fill that costs nothing.
Run it with ``python -m vllm_kvfill_patch.fidelity``; nothing at run time
imports it."""
