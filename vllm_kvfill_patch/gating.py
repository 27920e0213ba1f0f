"""Decide whether the installed vLLM's DecodeBenchConnector needs the patch.

The decision comes from the connector's structure and behaviour; the release
policy (``releases.SUPPORT_POLICY``) is the cross-check. Where the two
disagree, or the structure is not one this package knows, the patch refuses
rather than guess.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass
from types import ModuleType

from vllm_kvfill_patch.releases import policy_for

CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"
FILL_SIGNATURE = ("self", "group_idx", "block_ids", "num_tokens")
STEP_SIGNATURE = ("self", "metadata")


class Decision(str, enum.Enum):
    PENDING = "pending"
    """The connector module has not been imported in this process yet."""
    APPLIED = "applied"
    INERT = "inert"
    REFUSED = "refused"
    DISABLED = "disabled"
    REVERTED = "reverted"
    """``revert()`` took the patch out; ``apply()`` puts it back."""


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str


def judge(module: ModuleType, vllm_version: str) -> Verdict:
    """What to do with the loaded connector module of vLLM `vllm_version`."""
    structural = _judge_structure(module)
    policy = policy_for(vllm_version)
    if structural.decision is Decision.REFUSED or policy is None:
        return structural
    if structural.decision is not Decision(policy.decision):
        return Verdict(
            Decision.REFUSED,
            f"the connector's structure says {structural.decision.value} "
            f"({structural.reason}), but vLLM {vllm_version} is expected to be "
            f"{policy.decision} ({policy.why})",
        )
    return structural


def _judge_structure(module: ModuleType) -> Verdict:
    worker_cls = getattr(module, "DecodeBenchConnectorWorker", None)
    connector_cls = getattr(module, "DecodeBenchConnector", None)
    fill_blocks = getattr(worker_cls, "_fill_blocks", None)
    if fill_blocks is None or not hasattr(connector_cls, "register_kv_caches"):
        return Verdict(
            Decision.REFUSED,
            "expected DecodeBenchConnectorWorker._fill_blocks and "
            "DecodeBenchConnector.register_kv_caches; found "
            f"worker={worker_cls!r}, _fill_blocks={fill_blocks!r}, "
            f"connector={connector_cls!r}",
        )
    params = tuple(inspect.signature(fill_blocks).parameters)
    if params != FILL_SIGNATURE:
        return Verdict(
            Decision.REFUSED,
            f"expected _fill_blocks{FILL_SIGNATURE}, found _fill_blocks{params}",
        )
    start_fill_kv = getattr(worker_cls, "start_fill_kv", None)
    step_params = (
        tuple(inspect.signature(start_fill_kv).parameters) if start_fill_kv else ()
    )
    if step_params != STEP_SIGNATURE:
        return Verdict(
            Decision.REFUSED,
            f"expected start_fill_kv{STEP_SIGNATURE}, found start_fill_kv{step_params}",
        )
    if "kv_cache_config" in inspect.signature(worker_cls.__init__).parameters:
        return Verdict(
            Decision.INERT,
            "upstream's worker builds its own per-group layer map from the "
            "KV-cache config",
        )
    return _judge_by_probe(worker_cls, fill_blocks)


class _ProbeResult(enum.Enum):
    CRASHES = "crashes"
    WHOLE_TENSOR = "whole tensor"
    ROWS_ONLY = "rows only"


def _judge_by_probe(worker_cls: type, fill_blocks) -> Verdict:
    try:
        result = _probe_state_fill(worker_cls, fill_blocks)
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown"
        return Verdict(
            Decision.REFUSED,
            "expected _fill_blocks to crash on, or fill, a list state cache; "
            f"it raised {type(exc).__name__}: {exc}",
        )
    if result is None:
        return Verdict(
            Decision.REFUSED,
            "expected _fill_blocks to crash on, or fill, a list state cache; "
            "it wrote nothing",
        )
    if result is _ProbeResult.CRASHES:
        return Verdict(
            Decision.APPLIED,
            "_fill_blocks crashes on list/tuple (Mamba) caches",
        )
    if result is _ProbeResult.WHOLE_TENSOR:
        return Verdict(
            Decision.APPLIED,
            "_fill_blocks fills list/tuple state tensors whole",
        )
    return Verdict(Decision.INERT, "_fill_blocks fills only the requested state rows")


def _probe_state_fill(worker_cls: type, fill_blocks) -> _ProbeResult | None:
    """Run the original `_fill_blocks` on a tiny list state cache, block 1 only."""
    import torch  # loaded with vLLM by now; importing this package must not

    state = torch.zeros(4, 2)
    worker = object.__new__(worker_cls)
    worker.kv_caches = {"probe": [state]}
    worker.group_to_layers = {0: ["probe"]}
    worker.fill_mean = 1.0
    worker.fill_std = 0.0
    try:
        fill_blocks(worker, 0, [1], 1)
    except AttributeError as exc:
        if "'list' object has no attribute" in str(exc):
            return _ProbeResult.CRASHES
        raise
    touched = set(state.ne(0).any(dim=1).nonzero().flatten().tolist())
    if not touched:
        return None
    return _ProbeResult.ROWS_ONLY if touched == {1} else _ProbeResult.WHOLE_TENSOR
