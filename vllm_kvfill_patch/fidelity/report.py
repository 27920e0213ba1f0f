"""What a run found: the verdict lines, the tables, the preemption finding.

Each cell (a mode at a concurrency in a case) is read once into a `Row`: its
figures over every leg's requests, each figure of the bar against its
reference's (`stats.pooled_ratio`, legs paired), the fill's time per step.
The verdict, the terminal table, the full table (Markdown, CSV, JSON) and the
picture all read the rows.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import statistics
from dataclasses import dataclass, field
from functools import cached_property

from vllm_kvfill_patch.fidelity.attribution import (
    Effect,
    fill_effect,
    fill_share,
    standing_of,
    step_p50_ms,
    steps_of,
)
from vllm_kvfill_patch.fidelity.client import PERCENTILE_KEY, combined, request_seconds
from vllm_kvfill_patch.fidelity.modes import (
    LINKED,
    MODES,
    PACKAGE,
    REFILL,
    UPSTREAM,
    Mode,
)
from vllm_kvfill_patch.fidelity.stats import BAR, Bar, Ratio, Standing, pooled_ratio
from vllm_kvfill_patch.fidelity.wire import FILL_BUCKETS, counted, fill_bucket_bound


@dataclass(frozen=True, order=True)
class Key:
    case: str
    concurrency: int
    mode: str


@dataclass
class Cell:
    """One mode at one concurrency: each round's figures (over its legs),
    each leg's result, and why it did not run."""

    runs: list[dict] = field(default_factory=list)
    legs: list[dict] = field(default_factory=list)
    """vLLM's result of each leg, with its ``round`` and ``leg``; only the
    request lists `request_seconds` reads and the scalars."""
    error: str | None = None

    def total(self, key: str) -> float:
        return sum(run[key] for run in self.runs)

    def spread(self, key: str) -> float:
        """(max - min) / median over the rounds, 0 for one round."""
        values = [run[key] for run in self.runs]
        middle = statistics.median(values) if values else 0
        return (max(values) - min(values)) / middle if middle else 0.0


def metric_of(key: str) -> tuple[str, float]:
    """The metric and percentile a key of vLLM's result names:
    ``median_tpot_ms`` -> ``("tpot", 50.0)``, ``p99_itl_ms`` -> ``("itl", 99.0)``."""
    if key.startswith("median_"):
        return key.removeprefix("median_").removesuffix("_ms"), 50.0
    match = PERCENTILE_KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"{key} is not a percentile of vLLM's result")
    return match[2], float(match[1])


def against(cell: Cell, reference: Cell | None, key: str) -> Ratio | None:
    """The mode's figure over all its legs against the reference's, leg
    paired with leg (same round, same leg: seconds apart on one server), or
    None where either did not run."""
    if reference is None or reference.error or not reference.legs or not cell.legs:
        return None
    theirs = {(leg["round"], leg["leg"]): leg for leg in reference.legs}
    pairs = [
        (leg, theirs[unit])
        for leg in cell.legs
        if (unit := (leg["round"], leg["leg"])) in theirs
    ]
    if not pairs:
        return None
    metric, percentile = metric_of(key)
    return pooled_ratio(
        [request_seconds(ours)[metric] for ours, _ in pairs],
        [request_seconds(ref)[metric] for _, ref in pairs],
        percentile,
    )


def fill_p99_ms(cell: Cell) -> float | None:
    """The 99th percentile of the fill's time per forward pass (the upper
    bound of its histogram bucket: at most 1% above it)."""
    histogram = [0] * FILL_BUCKETS
    for run in cell.runs:
        histogram = counted(histogram, run["fill_histogram"])
    rank = math.ceil(0.99 * sum(histogram))
    if not rank:
        return None
    seen = itertools.accumulate(histogram)
    bucket = next(k for k, count in enumerate(seen) if count >= rank)
    return fill_bucket_bound(bucket) * 1000


@dataclass
class Row:
    """A cell, read once."""

    key: Key
    cell: Cell
    reference: Cell | None

    @property
    def mode(self) -> Mode:
        return MODES[self.key.mode]

    @cached_property
    def figures(self) -> dict:
        return combined(self.cell.legs)

    @cached_property
    def ratios(self) -> dict[str, Ratio | None]:
        """Each figure of the bar against the reference's (none for a
        reference)."""
        if self.mode.reference is None:
            return {}
        return {bar.key: against(self.cell, self.reference, bar.key) for bar in BAR}

    @cached_property
    def fill_p99_ms(self) -> float | None:
        return fill_p99_ms(self.cell)

    @cached_property
    def effects(self) -> dict[Bar, Effect | None]:
        """What the fill adds to each figure of the bar, inside the legs
        (`attribution`); empty for a mode without this connector's fill."""
        if self.mode.setting is None:
            return {}
        steps = steps_of(self.cell.legs)
        return {bar: fill_effect(steps, bar.key, self.figures[bar.key]) for bar in BAR}

    @property
    def fill_mean_ms(self) -> float | None:
        calls = self.cell.total("fill_calls")
        return self.cell.total("fill_seconds") * 1000 / calls if calls else None

    def standing(self) -> Standing | None:
        """Outside where any figure is, within where all are, else
        undecided; None for a reference."""
        if not self.ratios:
            return None
        found = [
            ratio.standing(bar.tolerance) if ratio else Standing.UNDECIDED
            for bar, ratio in zip(BAR, self.ratios.values(), strict=True)
        ]
        for standing in (Standing.OUTSIDE, Standing.UNDECIDED):
            if standing in found:
                return standing
        return Standing.WITHIN

    def record(self) -> dict:
        """Every figure of the row, as numbers (the full table)."""
        figures = self.figures
        record: dict = {
            "case": self.key.case, "mode": self.key.mode,
            "concurrency": self.key.concurrency, "reference": self.mode.reference,
            **{key: figures[key] for key in FULL_FIGURES},
            "tpot_p50_spread": self.cell.spread("median_tpot_ms"),
            "fill_mean_ms": self.fill_mean_ms, "fill_p99_ms": self.fill_p99_ms,
            "fill_p99_of_itl_p99": share(self.fill_p99_ms, figures["p99_itl_ms"]),
            "preemptions": self.cell.total("preemptions"),
            "recomputed_tokens": self.cell.total("reprefilled_tokens"),
            "read_in_bursts": self.cell.total("read_in_bursts"),
            "expert_max_over_mean": expert_imbalance(self.cell),
            "subnormal_outputs": self.cell.total("subnormal_outputs"),
            "worker_step_p50_ms": step_p50_ms(steps_of(self.cell.legs)),
            "rounds": len(self.cell.runs), "legs": len(self.cell.legs),
        }  # fmt: skip
        for bar in BAR:
            ratio = self.ratios.get(bar.key)
            record[f"{bar.key}_vs_reference"] = ratio and ratio.estimate
            record[f"{bar.key}_vs_reference_low"] = ratio and ratio.low
            record[f"{bar.key}_vs_reference_high"] = ratio and ratio.high
        record["standing"] = (standing := self.standing()) and standing.value
        for bar in BAR:
            effect = self.effects.get(bar)
            record[f"{bar.key}_fill_effect"] = effect and effect.estimate
            record[f"{bar.key}_fill_effect_low"] = effect and effect.low
            record[f"{bar.key}_fill_effect_high"] = effect and effect.high
        return record


FULL_FIGURES = (
    "request_throughput", "output_throughput", "median_ttft_ms",
    "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "mean_itl_ms",
)  # fmt: skip
"""vLLM's figures the full table keeps, over every leg's requests."""


def share(part: float | None, whole: float) -> float | None:
    return part / whole if part is not None and whole else None


def expert_imbalance(cell: Cell) -> float | None:
    forwards = cell.total("expert_forwards")
    return cell.total("expert_imbalance_sum") / forwards if forwards else None


def rows(cells: dict[Key, Cell]) -> tuple[list[Row], dict[Key, str]]:
    """The cells that ran, read once, in the table's order; and why the rest
    did not."""
    order = list(MODES)
    found, failed = [], {}
    for key in sorted(
        cells,
        key=lambda k: (k.case != "main", k.case, k.concurrency, order.index(k.mode)),
    ):
        cell = cells[key]
        if cell.error is not None or not cell.legs:
            failed[key] = cell.error or "no leg completed"
            continue
        reference = MODES[key.mode].reference
        theirs = cells.get(Key(key.case, key.concurrency, reference or ""))
        found.append(Row(key, cell, theirs))
    return found, failed


VERDICT_ORDER = (PACKAGE, LINKED, UPSTREAM, REFILL)
"""The connector modes the verdict speaks of, the package's first (real
prefill, one round, is in the table)."""


def verdict_lines(found: list[Row]) -> list[str]:
    """Per case and concurrency, each connector mode's standing in words."""
    bars = ", ".join(f"{bar.name} ±{bar.tolerance:.0%}" for bar in BAR)
    lines = [f"The legs against the ideal ({bars}; 95% intervals):"]
    compared = [row for row in found if row.ratios and row.mode in VERDICT_ORDER]
    for (case, concurrency), group in itertools.groupby(
        compared, key=lambda row: (row.key.case, row.key.concurrency)
    ):
        ordered = sorted(group, key=lambda row: VERDICT_ORDER.index(row.mode))
        said = "; ".join(mode_verdict(row) for row in ordered)
        lines.append(f"  {case} C={concurrency}: {said}")
    return lines


def attribution_lines(found: list[Row]) -> list[str]:
    """Per case and concurrency, each connector mode's standing decided by
    what its fill adds inside the legs, and whether the legs agree."""
    bars = ", ".join(f"{bar.name} ±{bar.tolerance:.0%}" for bar in BAR)
    lines = [
        f"Verdict by attribution: the fill's own time taken out of every decode "
        f"step of the legs ({bars}; 95% intervals), the legs as the cross-check:"
    ]
    compared = [row for row in found if row.ratios and row.mode in VERDICT_ORDER]
    for (case, concurrency), group in itertools.groupby(
        compared, key=lambda row: (row.key.case, row.key.concurrency)
    ):
        ordered = sorted(group, key=lambda row: VERDICT_ORDER.index(row.mode))
        lines.append(f"  {case} C={concurrency}:")
        lines += [f"    {attributed_verdict(row)}" for row in ordered]
    return lines


def attributed_verdict(row: Row) -> str:
    effects = row.effects
    if not effects or None in effects.values():
        return f"{row.key.mode}: no steps recorded; by the legs, {mode_verdict(row)}"
    reference = row.mode.reference
    word = {
        Standing.WITHIN: f"within the bar of {reference}",
        Standing.OUTSIDE: f"outside the bar of {reference}",
        Standing.UNDECIDED: f"undecided against {reference}",
    }[standing_of(effects)]
    added = ", ".join(f"{bar.name} {e.text()}" for bar, e in effects.items() if e)
    shares = fill_share(steps_of(row.cell.legs))
    per_step = (
        f"; fill p50 {shares[0]:.3f} ms, p99 {shares[1]:.3f} ms a step"
        if shares
        else ""
    )
    legs = ", ".join(
        f"{bar.name} {r.text() if (r := row.ratios[bar.key]) else 'not compared'}"
        for bar in BAR
    )
    agree = [e.consistent(row.ratios[bar.key]) for bar, e in effects.items() if e]
    cross = (
        "no interval to hold it to (too few legs)"
        if None in agree
        else "consistent"
        if all(agree)
        else "not consistent"
    )
    return (
        f"{row.key.mode} {word}: its fill adds {added}"
        f"{per_step}; the legs measured {legs}: {cross}"
    )


def mode_verdict(row: Row) -> str:
    standing = row.standing()
    ratios = [(bar, row.ratios[bar.key]) for bar in BAR]
    reference = row.mode.reference
    if standing is Standing.WITHIN:
        figures = ", ".join(f"{bar.name} {r.text()}" for bar, r in ratios if r)
        return f"{row.key.mode} within the bar of {reference} ({figures})"
    wanted = Standing.OUTSIDE if standing is Standing.OUTSIDE else Standing.UNDECIDED
    figures = ", ".join(
        f"{bar.name} {r.text() if r else 'not compared'}"
        for bar, r in ratios
        if r is None or r.standing(bar.tolerance) is wanted
    )
    if standing is Standing.OUTSIDE:
        return f"{row.key.mode} outside the bar of {reference} by {figures}"
    return f"{row.key.mode} undecided on this machine ({figures})"


TERMINAL_HEADINGS = (
    "mode", "C", "TPOT p50 ms", "vs ideal [95% CI]", "ITL p99 ms",
    "vs ideal [95% CI]", "fill p99 (of ITL p99)", "preempted", "recomputed tok",
)  # fmt: skip


def terminal_table(found: list[Row], failed: dict[Key, str], case: str) -> str:
    """A case's table in at most ten columns, as Markdown."""
    lines = [
        "| " + " | ".join(TERMINAL_HEADINGS) + " |",
        "|" + "---|" * len(TERMINAL_HEADINGS),
    ]
    for row in found:
        if row.key.case != case:
            continue
        figures, ratios = row.figures, row.ratios
        compared = [ratios[bar.key] for bar in BAR] if ratios else [None, None]
        fill = "-"
        if row.fill_p99_ms is not None:
            part = share(row.fill_p99_ms, figures["p99_itl_ms"]) or 0.0
            fill = f"{row.fill_p99_ms:.3f} ms ({part:.1%})"
        cells = [
            row.key.mode, str(row.key.concurrency),
            f"{figures['median_tpot_ms']:.2f}",
            compared[0].text() if compared[0] else "(reference)",
            f"{figures['p99_itl_ms']:.2f}",
            compared[1].text() if compared[1] else "(reference)",
            fill, f"{row.cell.total('preemptions'):.0f}",
            f"{row.cell.total('reprefilled_tokens'):.0f}",
        ]  # fmt: skip
        if row.mode.reference is None:
            cells[3] = cells[5] = "(reference)"
        elif not ratios:
            cells[3] = cells[5] = "-"
        lines.append("| " + " | ".join(cells) + " |")
    for key, error in failed.items():
        if key.case == case:
            why = error.replace("|", "\\|")
            lines.append(f"| {key.mode} | {key.concurrency} | did not run: {why} |")
    return "\n".join(lines)


def full_records(found: list[Row]) -> list[dict]:
    return [row.record() for row in found]


def markdown(records: list[dict]) -> str:
    """The full table, every record's every field, as Markdown."""
    if not records:
        return ""
    headings = list(records[0])
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    for record in records:
        lines.append("| " + " | ".join(formatted(record[h]) for h in headings) + " |")
    return "\n".join(lines)


def comma_separated(records: list[dict]) -> str:
    out = io.StringIO()
    if records:
        writer = csv.DictWriter(out, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    return out.getvalue()


def formatted(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def preemption_finding(found: list[Row]) -> list[str]:
    """When any mode preempted, in plain words: how many requests, how many
    tokens recomputed, and that a decode node would do the same."""
    lines = []
    for (case, concurrency), group in itertools.groupby(
        found, key=lambda row: (row.key.case, row.key.concurrency)
    ):
        preempting = [row for row in group if row.cell.total("preemptions")]
        if not preempting:
            continue
        counts = ", ".join(
            f"{row.key.mode} {row.cell.total('preemptions'):.0f} requests, "
            f"{row.cell.total('reprefilled_tokens'):.0f} tokens recomputed"
            for row in preempting
        )
        lines.append(f"  {case} C={concurrency}: {counts}")
    if not lines:
        return []
    return [
        "Preemption: vLLM preempted requests, and recomputed them when they resumed:",
        *lines,
        "A decode node at this concurrency and KV cache size would do the same "
        "(it takes a request's KV once). To measure steady decode, lower the "
        "concurrency or raise the KV cache memory.",
    ]
