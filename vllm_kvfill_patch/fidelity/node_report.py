"""Every mode against the real decode node: decode TTFT, TPOT p50 and ITL
p99 with their 95% intervals, legs paired by prompts (same round and leg,
same seed), how long a request waited for its KV, and the worker's median
step (how much of a gap is the model's step, and how much is around it);
in words how far each emulated mode's TTFT is from the node's, and why; and
the link the linked modes cross, fitted to the node's transfers."""

from __future__ import annotations

import numpy as np

from vllm_kvfill_patch.fidelity.attribution import step_p50_ms, steps_of
from vllm_kvfill_patch.fidelity.client import ways_in_and_out
from vllm_kvfill_patch.fidelity.modes import NODE
from vllm_kvfill_patch.fidelity.report import Row, against
from vllm_kvfill_patch.fidelity.stats import Ratio
from vllm_kvfill_patch.fidelity.transfers import Transfers

AGAINST_NODE = (
    ("median_ttft_ms", "decode TTFT p50"),
    ("median_tpot_ms", "TPOT p50"),
    ("p99_itl_ms", "ITL p99"),
)
"""The figures each mode is held to the node's by: TTFT measured from the
request's arrival at decode (every prompt prefilled before its leg)."""
HEADINGS = (
    "mode",
    "C",
    *(h for _, name in AGAINST_NODE for h in (f"{name} ms", "vs node")),
    "KV wait p50 ms",
    "worker step p50 ms",
)
"""At most ten: the figures against the node, then how long a request waited
for its KV (admitted to scheduled) and the worker's median step."""
WHY_TTFT = (
    "an emulated mode's KV arrives inside the step that admits the request, "
    "while the node reads it from prefill over NIXL before scheduling it"
)
WHY_LINKED = (
    "a linked mode's request waits for its KV on the modelled link as the "
    "node's waits on NIXL"
)
ENGINE_TTFT = "median_engine_ttft_ms"
"""From a request's arrival at the server to the engine's first token for it
(the probe's `first_tokens`): the decode TTFT without the way in and out
(client, proxy, API server), which the connector does not touch."""


def kv_wait_p50_ms(legs: list[dict]) -> float | None:
    """How long a request of the legs waited for its KV, at the median, in
    milliseconds (None where none waited: its KV arrived at admission)."""
    return p50_ms(legs, "kv_waits")


def p50_ms(legs: list[dict], key: str) -> float | None:
    """The median of a list of seconds the legs recorded, in milliseconds."""
    values = [value for leg in legs for value in leg.get(key, [])]
    return float(np.median(values)) * 1000 if values else None


def fitted_link(transfers: Transfers | None) -> tuple[float, float | None] | None:
    """The link model (latency ms, Gb/s per rank) the linked modes cross:
    the real node's transfers at its lowest concurrency as NIXL timed them
    (post to completion), their mean bytes in their mean time, one at a
    time. No latency besides: the link's time starts, as NIXL's read does,
    when a worker takes the step that admitted the request, and the steps
    around it are the engine's in both. None where the node timed none."""
    mean = transfers.mean_seconds() if transfers is not None else None
    if transfers is None or not mean:
        return None
    return (0.0, round(transfers.bytes_each() * 8 / mean / 1e9, 3))


def node_rows(found: list[Row]) -> dict[tuple[str, int], Row]:
    """The node's row per case and concurrency."""
    return {(r.key.case, r.key.concurrency): r for r in found if r.mode is NODE}


def ratios(row: Row, node: Row) -> dict[str, Ratio | None]:
    return {key: against(row.cell, node.cell, key) for key, _ in AGAINST_NODE}


def node_table(found: list[Row]) -> str:
    """Each mode beside the node it emulates, as Markdown ('' without one)."""
    nodes = node_rows(found)
    if not nodes:
        return ""
    lines = ["| " + " | ".join(HEADINGS) + " |", "|" + "---|" * len(HEADINGS)]
    for row in found:
        node = nodes.get((row.key.case, row.key.concurrency))
        if node is None:
            continue
        compared = ratios(row, node) if row is not node else {}
        cells = [row.key.mode, str(row.key.concurrency)]
        for key, _ in AGAINST_NODE:
            ratio = compared.get(key)
            cells.append(f"{row.figures[key]:.2f}")
            cells.append(
                "(the node)" if row is node else ratio.text() if ratio else "-"
            )
        wait = kv_wait_p50_ms(row.cell.legs)
        cells.append(f"{wait:.1f}" if wait is not None else "-")
        step = step_p50_ms(steps_of(row.cell.legs))
        cells.append(f"{step:.2f}" if step is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ttft_lines(found: list[Row], transfer_p50_ms: float | None) -> list[str]:
    """Per concurrency, how far each emulated mode's decode TTFT is from the
    node's, and why, in a sentence; then where each one's TTFT went before
    its first step, as measured in the scheduler."""
    lines = []
    transfer = (
        f" (p50 {transfer_p50_ms:.1f} ms a transfer here)"
        if transfer_p50_ms is not None
        else ""
    )
    for (case, concurrency), node in node_rows(found).items():
        emulated = [
            row
            for row in found
            if row.mode.setting is not None
            and (row.key.case, row.key.concurrency) == (case, concurrency)
        ]
        said = []
        for row in emulated:
            ratio = against(row.cell, node.cell, "median_ttft_ms")
            said.append(
                f"{row.key.mode} {row.figures['median_ttft_ms']:.1f} ms"
                + (f" ({ratio.text()})" if ratio else "")
            )
        if said:
            linked = any(row.mode.linked for row in emulated)
            lines.append(
                f"Decode TTFT at C={concurrency}: the real node "
                f"{node.figures['median_ttft_ms']:.1f} ms; {', '.join(said)}: "
                f"{WHY_TTFT}{transfer}" + (f"; {WHY_LINKED}." if linked else ".")
            )
            lines.append(f"  {engine_line(node, emulated)}")
            lines.append(f"  {phases_line([node, *emulated])}")
    return lines


def engine_line(node: Row, emulated: list[Row]) -> str:
    """How far each mode's engine TTFT is from the node's: where a decode
    TTFT gap comes from the way in and out, not from what the connector
    does, the engine's figures say so."""
    if ENGINE_TTFT not in node.figures:
        return "no engine TTFT recorded"
    said = []
    for row in emulated:
        if ENGINE_TTFT not in row.figures:
            continue
        ratio = against(row.cell, node.cell, ENGINE_TTFT)
        said.append(
            f"{row.key.mode} {row.figures[ENGINE_TTFT]:.1f} ms"
            + (f" ({ratio.text()})" if ratio else "")
        )
    return (
        f"Engine TTFT (arrival at the server to the engine's first token): the "
        f"real node {node.figures[ENGINE_TTFT]:.1f} ms; {', '.join(said)}"
    )


def phases_line(found: list[Row]) -> str:
    """Where each mode's TTFT went (p50s): the way in (vLLM's client to the
    request's arrival at the server), arrival to admission, the wait for
    its KV, its first step (the engine's TTFT less both), and the way out
    (the engine's first token to the client's); the way in and out from
    each request's own times (`client.ways_in_and_out`)."""
    parts = []
    for row in found:
        admission = p50_ms(row.cell.legs, "admissions")
        engine = row.figures.get(ENGINE_TTFT)
        ways = [way for leg in row.cell.legs for way in ways_in_and_out(leg)]
        if admission is None or engine is None or not ways:
            continue
        way_in, way_out = np.median(np.asarray(ways), axis=0) * 1000
        wait = kv_wait_p50_ms(row.cell.legs) or 0.0
        step = engine - admission - wait
        parts.append(
            f"{row.key.mode} {way_in:.1f} + {admission:.1f} + {wait:.1f} + "
            f"{step:.1f} + {way_out:.1f} ms"
        )
    return (
        "TTFT p50 as the way in + arrival to admission + wait for KV + first "
        "step + the way out: " + "; ".join(parts)
        if parts
        else "no admission recorded"
    )
