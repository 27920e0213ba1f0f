"""Every mode against the real decode node: decode TTFT, TPOT p50 and ITL
p99 with their 95% intervals, legs paired by prompts (same round and leg,
same seed), and the worker's median step (how much of a gap is the model's
step, and how much is around it); and in words how far each emulated
mode's TTFT is from the node's, and why."""

from __future__ import annotations

from vllm_kvfill_patch.fidelity.attribution import step_p50_ms, steps_of
from vllm_kvfill_patch.fidelity.modes import NODE
from vllm_kvfill_patch.fidelity.report import Row, against
from vllm_kvfill_patch.fidelity.stats import Ratio

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
)
WHY_TTFT = (
    "an emulated mode's KV arrives inside the step that admits the request, "
    "while the node reads it from prefill over NIXL before scheduling it"
)
WHY_LINKED = (
    "a linked mode's request waits for its KV on the modelled link as the "
    "node's waits on NIXL"
)


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
        step = step_p50_ms(steps_of(row.cell.legs))
        cells.append(f"{step:.2f}" if step is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ttft_lines(found: list[Row], transfer_p50_ms: float | None) -> list[str]:
    """Per concurrency, how far each emulated mode's decode TTFT is from the
    node's, and why, in a sentence."""
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
    return lines
