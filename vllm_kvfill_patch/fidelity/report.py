"""The tool's table and picture, from the runs' figures."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from vllm_kvfill_patch.fidelity.modes import IDEAL
from vllm_kvfill_patch.fidelity.probe import FILL_BUCKETS, counted, fill_bucket_bound


@dataclass
class Cell:
    """One mode at one concurrency: each run's figures, and why it did not run."""

    runs: list[dict] = field(default_factory=list)
    error: str | None = None

    def median(self, key: str) -> float:
        return statistics.median(run[key] for run in self.runs)

    def spread(self, key: str) -> float:
        """(max - min) / median over the runs, 0 for one run."""
        values = [run[key] for run in self.runs]
        middle = statistics.median(values)
        return (max(values) - min(values)) / middle if middle else 0.0

    def total(self, key: str) -> float:
        return sum(run[key] for run in self.runs)


COLUMNS = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.0f}"),
    ("TTFT p50", "median_ttft_ms", "{:.1f}"),
    ("TPOT p50", "median_tpot_ms", "{:.1f}"),
    ("TPOT p99", "p99_tpot_ms", "{:.1f}"),
    ("ITL p50", "median_itl_ms", "{:.1f}"),
    ("ITL p99", "p99_itl_ms", "{:.1f}"),
)
"""(heading, key of vLLM's result JSON, format): medians over the runs."""


def expert_imbalance(cell: Cell) -> str:
    forwards = cell.total("expert_forwards")
    if not forwards:
        return "-"
    return f"{cell.total('expert_imbalance_sum') / forwards:.2f}"


def fill_per_step(cell: Cell) -> str:
    """The worker's time in the connector's fill per forward pass, and its
    share of the mean inter-token latency: how much of each decode step the
    write itself takes, measured inside vLLM rather than read off the
    noisier end-to-end figures."""
    calls = cell.total("fill_calls")
    if not calls:
        return "-"
    per_step = cell.total("fill_seconds") * 1000 / calls
    return f"{per_step:.3f} ms ({per_step / cell.median('mean_itl_ms'):.1%})"


def slowest_fills(cell: Cell) -> str:
    """The 99th percentile of the fill's time per forward pass (the upper
    bound of its histogram bucket: at most 19% above it), and its share of
    ITL p99: what the fill can add to the slowest steps."""
    histogram = [0] * FILL_BUCKETS
    for run in cell.runs:
        histogram = counted(histogram, run["fill_histogram"])
    rank = math.ceil(0.99 * sum(histogram))
    if not rank:
        return "-"
    bucket = next(
        k for k, seen in enumerate(itertools.accumulate(histogram)) if seen >= rank
    )
    p99 = fill_bucket_bound(bucket) * 1000
    return f"{p99:.3f} ms ({p99 / cell.median('p99_itl_ms'):.1%})"


CONFIDENCE = 0.95


@dataclass(frozen=True)
class PairedRatio:
    """How much larger one set of paired measurements is than its reference:
    the median of the pairs' ratios minus one, and an interval of two of the
    ratios' order statistics that holds the true median with `confidence`."""

    median: float
    low: float
    high: float
    confidence: float
    pairs: int

    def text(self, digits: int) -> str:
        """`+1.2% [-3.4%, +5.6%]`, with the interval's confidence after it
        where too few pairs give 95%; the median alone for one pair."""
        middle = f"{self.median:+.{digits}%}"
        if self.pairs == 1:
            return middle
        interval = f"{middle} [{self.low:+.{digits}%}, {self.high:+.{digits}%}]"
        if self.confidence < CONFIDENCE:
            interval += f" ({self.confidence:.0%})"
        return interval


def paired_ratio(values: list[float], references: list[float]) -> PairedRatio:
    """Distribution-free: the number of ratios below their true median is
    binomial(n, 1/2), so the interval that leaves out the k smallest and the
    k largest misses it with probability 2 P(B <= k). The widest k that keeps
    that at most 5% is taken; under six pairs even the range cannot, and the
    range is given with its own confidence (75% for three)."""
    ratios = sorted(v / r - 1 for v, r in zip(values, references, strict=True))
    n = len(ratios)

    def confidence(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n

    k = 0
    while 2 * (k + 1) < n and confidence(k + 1) >= CONFIDENCE:
        k += 1
    return PairedRatio(
        statistics.median(ratios), ratios[k], ratios[n - 1 - k], confidence(k), n
    )


def paired_with_ideal(cell: Cell, ideal: Cell | None, key: str) -> PairedRatio | None:
    """The mode against the ideal, round by round (`paired_ratio`), or None
    where either did not run. Runs of one round ran minutes apart at most,
    so a slow spell of the machine moves both; the interval says what the
    median can be trusted to within this run (a difference inside it is
    noise, and more rounds narrow it). What all the rounds share, the run's
    spell of the machine, it does not see. What sets one start of a server
    apart it sees since the main case's servers start afresh every two rounds
    (`ROUNDS_PER_SERVER`); with one start a run, two runs' intervals at
    concurrency 1 missed each other (docs/benchmark.md)."""
    if ideal is None or ideal.error or not ideal.runs or not cell.runs:
        return None
    by_round = {run["round"]: run[key] for run in ideal.runs}
    paired = [run for run in cell.runs if by_round.get(run["round"])]
    if not paired:
        return None
    return paired_ratio(
        [run[key] for run in paired], [by_round[run["round"]] for run in paired]
    )


def against_ideal(cell: Cell, ideal: Cell | None, key: str) -> str:
    ratio = paired_with_ideal(cell, ideal, key)
    return "-" if ratio is None else ratio.text(1)


def table(cells: dict[tuple[str, str, int], Cell]) -> str:
    """One row per (case, mode, concurrency); figures are medians over runs."""
    headings = [
        "case", "mode", "C", *(h for h, _, _ in COLUMNS), "TPOT p50 spread",
        "preempted", "re-prefilled tok", "read in bursts", "expert max/mean",
        "subnormal",
        "fill per step (of ITL)", "fill p99 (of ITL p99)",
        "TPOT p50 vs ideal [95% CI]", "ITL p99 vs ideal [95% CI]",
    ]  # fmt: skip
    rows = []
    for (case, mode, concurrency), cell in cells.items():
        row = [case, mode, str(concurrency)]
        if cell.error is not None:
            rows.append([*row, "did not run: " + cell.error.replace("|", "\\|")])
            continue
        row += [fmt.format(cell.median(key)) for _, key, fmt in COLUMNS]
        row.append(f"{cell.spread('median_tpot_ms'):.0%}")
        row.append(f"{cell.total('preemptions'):.0f}")
        row.append(f"{cell.total('reprefilled_tokens'):.0f}")
        row.append(f"{cell.total('read_in_bursts'):.0f}")
        row.append(expert_imbalance(cell))
        checked = cell.total("checked_outputs")
        row.append(f"{cell.total('subnormal_outputs'):.0f}" if checked else "-")
        row.append(fill_per_step(cell))
        row.append(slowest_fills(cell))
        ideal = cells.get((case, IDEAL, concurrency))
        if mode == IDEAL:
            row += ["(reference)", "(reference)"]
        else:
            row.append(against_ideal(cell, ideal, "median_tpot_ms"))
            row.append(against_ideal(cell, ideal, "p99_itl_ms"))
        rows.append(row)
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


BAR = {"median_tpot_ms": ("TPOT p50", 0.02), "p99_itl_ms": ("ITL p99", 0.05)}
"""The differences from the ideal a run is meant to tell apart (the README's
2% / 5% bar): the figure's name, and how far from the ideal still counts as
equal."""


def undecided(cells: dict[tuple[str, str, int], Cell]) -> list[str]:
    """A warning, as lines, naming each mode and concurrency whose interval
    against the ideal reaches both inside and outside its `BAR`: that run
    cannot say whether the mode is within the bar, whatever its median
    reads; no lines where every interval is wholly inside or outside (a
    distortion such as upstream's re-prefills). With each, the ideal's own
    TPOT p50 spread: where the machine's speed moved during the run (pairing
    by round cancels a slow drift, not a spell within a round), every
    interval of that concurrency widens."""
    lines = []
    for (case, mode, concurrency), cell in cells.items():
        ideal = cells.get((case, IDEAL, concurrency))
        if mode == IDEAL or cell.error or ideal is None:
            continue
        figures = []
        for key, (figure, bar) in BAR.items():
            ratio = paired_with_ideal(cell, ideal, key)
            if ratio is None or ratio.pairs == 1:
                continue
            if (
                ratio.low < bar
                and ratio.high > -bar
                and (ratio.low < -bar or ratio.high > bar)
            ):
                figures.append(f"{figure} {ratio.low:+.1%} to {ratio.high:+.1%}")
        if figures:
            lines.append(
                f"  {case} C={concurrency} {mode}: {', '.join(figures)} (the "
                f"ideal's TPOT p50 spread {ideal.spread('median_tpot_ms'):.0%})"
            )
    if not lines:
        return []
    bars = ", ".join(f"{figure} ±{bar:.0%}" for figure, bar in BAR.values())
    return [
        f"warning: these intervals against the ideal reach both sides of the bar "
        f"({bars}), so this run cannot say whether those modes are within it:",
        *lines,
        "run again when the machine is steady (the spreads say how far its "
        "speed moved), or with more --rounds",
    ]


def picture(cells: dict[tuple[str, str, int], Cell], path: Path, title: str) -> str:
    """TPOT p50 and ITL p99 per mode against concurrency, as a PNG at `path`;
    what was drawn, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no picture: matplotlib is not installed (pip install matplotlib)"
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, (label, key) in zip(
        axes,
        (("TPOT p50 (ms)", "median_tpot_ms"), ("ITL p99 (ms)", "p99_itl_ms")),
        strict=True,
    ):
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for (case, mode, concurrency), cell in cells.items():
            if cell.runs and cell.error is None:
                series.setdefault((case, mode), []).append(
                    (concurrency, cell.median(key))
                )
        for (case, mode), points in series.items():
            points.sort()
            name = mode if case == "main" else f"{mode} ({case})"
            concurrencies, values = zip(*points, strict=True)
            axis.plot(concurrencies, values, marker="o", label=name)
        axis.set_xscale("log", base=2)
        ticks = sorted({n for (_, _, n) in cells})
        axis.set_xticks(ticks, [str(n) for n in ticks])
        axis.set_xlabel("concurrency")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)
