"""What a run prints and leaves in its folder: the verdict by attribution
first, then the legs' own, the table per case, every mode against the real
decode node, the preemption finding, the values' table; the full table as
Markdown, CSV and JSON, the picture, and each server's processes."""

from __future__ import annotations

import collections
import json
from pathlib import Path

from vllm_kvfill_patch.fidelity.node_report import node_table, ttft_lines
from vllm_kvfill_patch.fidelity.picture import draw
from vllm_kvfill_patch.fidelity.report import (
    Cell,
    Key,
    Row,
    attribution_lines,
    comma_separated,
    full_records,
    markdown,
    preemption_finding,
    rows,
    terminal_table,
    verdict_lines,
)
from vllm_kvfill_patch.fidelity.serve import Server

CASE_TITLES = {
    "main": "The main case",
    "preemption": "The preemption case (a KV cache small enough that vLLM preempts)",
}


def report(
    output: Path,
    cells: dict[Key, Cell],
    servers: list[Server],
    title: str,
    values: str,
) -> None:
    found, failed = rows(cells)
    print("\n".join(attribution_lines(found)))
    print("\n".join(verdict_lines(found)))
    for case in dict.fromkeys(key.case for key in cells):
        print(f"\n{CASE_TITLES.get(case, case)}:")
        print(terminal_table(found, failed, case))
    node_said(found, servers)
    if finding := preemption_finding(found):
        print("\n" + "\n".join(finding))
    if values:
        print("\n" + values)
    records = full_records(found)
    (output / "table.md").write_text(markdown(records) + "\n")
    (output / "table.csv").write_text(comma_separated(records))
    (output / "table.json").write_text(json.dumps(records, indent=1))
    print(f"\npicture: {draw(found, output / 'decode.png', title)}")
    for server in servers:
        decisions = collections.Counter(server.decisions())
        said = ", ".join(f"{d} {n}" for d, n in decisions.items())
        switched = f"; {server.switches} switches, each checked in every process"
        print(
            f"{server.name}: this package's decision lines: {said or 'none'}"
            + (switched if server.switches else "")
        )
    started = [name for server in servers for name in server.started()]
    print(f"servers started: {len(started)} ({', '.join(started)})")
    (output / "summary.json").write_text(json.dumps(summary(cells, servers), indent=1))
    print(f"the full table (table.md, .csv, .json), vLLM's result files and the "
          f"servers' logs: {output}")  # fmt: skip


def node_said(found: list[Row], servers: list[Server]) -> None:
    """Every mode beside the real decode node, what the node received, and
    the TTFT gap in words."""
    table = node_table(found)
    if not table:
        return
    print("\nAgainst the real decode node (95% intervals, legs paired by prompts):")
    print(table)
    p50 = None
    concurrencies = sorted({row.key.concurrency for row in found})
    for server in servers:
        if (received := server.transfers()) is not None:
            print(f"{server.name}: {received.said()}")
            p50 = received.quantile(0.5)
            for concurrency in concurrencies:
                if (at := server.transfers(concurrency)) is not None:
                    print(
                        f"  at C={concurrency}: {at.count:.0f} transfers, {at.timing()}"
                    )
        if (carried := server.link_carried()) is not None:
            print(f"{server.name}, its linked modes: {carried.said()}")
        if (paused := server.prefill_paused()) is not None:
            print(f"{server.name}: {paused}")
    print("\n".join(ttft_lines(found, p50 and p50 * 1000)))


def summary(cells: dict[Key, Cell], servers: list[Server]) -> dict:
    """Every round's figures, and where each server's processes ran."""
    return {
        "cells": [
            {"case": key.case, "mode": key.mode, "concurrency": key.concurrency,
             "runs": cell.runs, "error": cell.error}
            for key, cell in cells.items()
        ],
        "servers": {
            server.name: {
                "decisions": server.decisions(),
                "kernels": server.kernels(),
                "processes": server.processes(),
                "switches": server.switches,
                "link_carried": (carried := server.link_carried()) and {
                    "transfers": carried.count,
                    "bytes": carried.bytes,
                    "failed": carried.failed,
                },
                "placement": server.placement and {
                    "worker_cores": sorted(server.placement.worker_cores),
                    "front_cores": sorted(server.placement.front_cores),
                },
            }
            for server in servers
        },
    }  # fmt: skip
