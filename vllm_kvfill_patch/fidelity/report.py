"""The tool's table and picture, from the runs' figures."""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_kvfill_patch.fidelity.modes import IDEAL
from vllm_kvfill_patch.fidelity.probe import FILL_BUCKETS, counted, fill_bucket_bound
from vllm_kvfill_patch.fidelity.serve import PERCENTILE_KEY, combined, request_seconds


@dataclass
class Cell:
    """One mode at one concurrency: each round's figures (over its legs),
    each leg's result, and why it did not run."""

    runs: list[dict] = field(default_factory=list)
    legs: list[dict] = field(default_factory=list)
    """vLLM's result of each leg, with its ``round`` and ``leg``; only the
    request lists `request_seconds` reads and the scalars."""
    error: str | None = None

    def figures(self) -> dict:
        """vLLM's figures over every leg's requests, as of one long run."""
        return combined(self.legs)

    def spread(self, key: str) -> float:
        """(max - min) / median over the rounds, 0 for one round."""
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
"""(heading, key of vLLM's result JSON, format): over every round's requests."""


def expert_imbalance(cell: Cell) -> str:
    forwards = cell.total("expert_forwards")
    if not forwards:
        return "-"
    return f"{cell.total('expert_imbalance_sum') / forwards:.2f}"


def fill_per_step(cell: Cell, figures: dict) -> str:
    """The worker's time in the connector's fill per forward pass, and its
    share of the mean inter-token latency: how much of each decode step the
    write itself takes, measured inside vLLM rather than read off the
    noisier end-to-end figures."""
    calls = cell.total("fill_calls")
    if not calls:
        return "-"
    per_step = cell.total("fill_seconds") * 1000 / calls
    return f"{per_step:.3f} ms ({per_step / figures['mean_itl_ms']:.1%})"


def slowest_fills(cell: Cell, figures: dict) -> str:
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
    return f"{p99:.3f} ms ({p99 / figures['p99_itl_ms']:.1%})"


CONFIDENCE = 0.95
MIN_PAIRS = 6
"""Paired legs a comparison with the ideal needs for an interval
(`pooled_ratio`); with fewer, the figure alone."""
RESAMPLES = 2000


@dataclass(frozen=True)
class Ratio:
    """How much larger a figure is than its reference, and an interval that
    holds the true difference with `confidence` (None: too few pairs for
    one), from `pairs` paired measurements."""

    estimate: float
    low: float | None
    high: float | None
    confidence: float
    pairs: int

    def text(self, digits: int) -> str:
        """`+1.2% [-3.4%, +5.6%]`, with the interval's confidence after it
        where too few pairs give 95%; the estimate alone without one."""
        middle = f"{self.estimate:+.{digits}%}"
        if self.low is None or self.high is None:
            return middle
        interval = f"{middle} [{self.low:+.{digits}%}, {self.high:+.{digits}%}]"
        if self.confidence < CONFIDENCE:
            interval += f" ({self.confidence:.0%})"
        return interval


def paired_ratio(values: list[float], references: list[float]) -> Ratio:
    """The median of paired ratios, minus one, and an interval of two of the
    ratios' order statistics. Distribution-free: the number of ratios below
    their true median is binomial(n, 1/2), so the interval that leaves out
    the k smallest and the k largest misses it with probability 2 P(B <= k).
    The widest k that keeps that at most 5% is taken; under six pairs even
    the range cannot, and the range is given with its own confidence (75%
    for three)."""
    ratios = sorted(v / r - 1 for v, r in zip(values, references, strict=True))
    n = len(ratios)
    if n == 1:
        return Ratio(ratios[0], None, None, 0.0, 1)

    def confidence(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n

    k = 0
    while 2 * (k + 1) < n and confidence(k + 1) >= CONFIDENCE:
        k += 1
    return Ratio(
        statistics.median(ratios), ratios[k], ratios[n - 1 - k], confidence(k), n
    )


def pooled_ratio(
    samples: list[list[float]],
    references: list[list[float]],
    percentile: float,
    resamples: int = RESAMPLES,
) -> Ratio | None:
    """The percentile of every pair's samples together against the
    reference's, minus one: what one long run of each would read. Its
    interval is a paired bootstrap's: pairs drawn with replacement, both
    sides' samples of each drawn pair taken together (a percentile of
    samples weighted by how often their pair was drawn), the middle 95% of
    `resamples` such ratios; seeded, so that a table is reproducible. None
    where either side has no samples."""
    import numpy as np

    n = len(samples)
    if not any(samples) or not any(references):
        return None
    estimate = float(
        np.percentile(np.concatenate(samples), percentile)
        / np.percentile(np.concatenate(references), percentile)
        - 1
    )
    if n < MIN_PAIRS:
        return Ratio(estimate, None, None, 0.0, n)
    sides = [_sorted_with_pairs(side) for side in (samples, references)]
    draws = np.random.default_rng(0).integers(0, n, size=(resamples, n))
    ratios = np.empty(resamples)
    for i, drawn in enumerate(draws):
        weights = np.bincount(drawn, minlength=n)
        value, reference = (
            _weighted_percentile(*side, weights, percentile) for side in sides
        )
        ratios[i] = value / reference - 1 if reference else np.nan
    ratios = ratios[~np.isnan(ratios)]
    low, high = np.quantile(ratios, [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2])
    return Ratio(estimate, float(low), float(high), CONFIDENCE, n)


def _sorted_with_pairs(side: list[list[float]]) -> tuple[Any, Any, Any]:
    """Every pair's samples sorted together, the pair each came from, and
    how many samples each pair has."""
    import numpy as np

    sizes = np.array([len(samples) for samples in side])
    values = np.concatenate(side)
    pairs = np.repeat(np.arange(len(side)), sizes)
    order = np.argsort(values, kind="stable")
    return values[order], pairs[order], sizes


def _weighted_percentile(
    values: Any, pairs: Any, sizes: Any, weights: Any, percentile: float
) -> float:
    """The smallest sample at or above `percentile`% of the weight. A high
    percentile lies among the largest samples whatever the draw but for rare
    ones: those are summed first, and all of them only where it is not."""
    import numpy as np

    total = float(weights @ sizes)
    if not total:
        return 0.0
    rank = percentile / 100 * total
    tail = max(64, math.ceil(3 * (1 - percentile / 100) * len(values)))
    start = max(0, len(values) - tail)
    cumulative = np.cumsum(weights[pairs[start:]])
    below = total - float(cumulative[-1])
    if start and below >= rank:  # a rare draw: lower than the largest samples
        start, below = 0, 0.0
        cumulative = np.cumsum(weights[pairs])
    found = np.searchsorted(cumulative, rank - below)
    return float(values[start + min(found, len(cumulative) - 1)])


def metric_of(key: str) -> tuple[str, float]:
    """The metric and percentile a key of vLLM's result names:
    ``median_tpot_ms`` -> ``("tpot", 50.0)``, ``p99_itl_ms`` -> ``("itl", 99.0)``."""
    if key.startswith("median_"):
        return key.removeprefix("median_").removesuffix("_ms"), 50.0
    match = PERCENTILE_KEY.fullmatch(key)
    if match is None:
        raise ValueError(f"{key} is not a percentile of vLLM's result")
    return match[2], float(match[1])


def against_the_ideal(cell: Cell, ideal: Cell | None, key: str) -> Ratio | None:
    """The mode's figure over all its rounds against the ideal's, leg paired
    with leg (`pooled_ratio`), or None where either did not run. The modes
    take turns leg by leg, seconds apart, so a slow spell of the machine
    moves both sides of a pair; the interval says what the figure can be
    trusted to within this run (a difference inside it is noise, and more
    rounds narrow it). What all the legs share, the run's spell of the
    machine, it does not see. What sets one start of a server apart it sees
    since the main case's servers start afresh every two rounds
    (`ROUNDS_PER_SERVER`); with one start a run, two runs' intervals at
    concurrency 1 missed each other (docs/benchmark.md)."""
    if ideal is None or ideal.error or not ideal.legs or not cell.legs:
        return None
    reference = {(leg["round"], leg["leg"]): leg for leg in ideal.legs}
    pairs = [
        (leg, reference[unit])
        for leg in cell.legs
        if (unit := (leg["round"], leg["leg"])) in reference
    ]
    if not pairs:
        return None
    metric, percentile = metric_of(key)
    return pooled_ratio(
        [request_seconds(leg)[metric] for leg, _ in pairs],
        [request_seconds(leg)[metric] for _, leg in pairs],
        percentile,
    )


def against_ideal_text(cell: Cell, ideal: Cell | None, key: str) -> str:
    ratio = against_the_ideal(cell, ideal, key)
    return "-" if ratio is None else ratio.text(1)


def table(cells: dict[tuple[str, str, int], Cell]) -> str:
    """One row per (case, mode, concurrency); figures over all its rounds."""
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
        figures = cell.figures()
        row += [fmt.format(figures[key]) for _, key, fmt in COLUMNS]
        row.append(f"{cell.spread('median_tpot_ms'):.0%}")
        row.append(f"{cell.total('preemptions'):.0f}")
        row.append(f"{cell.total('reprefilled_tokens'):.0f}")
        row.append(f"{cell.total('read_in_bursts'):.0f}")
        row.append(expert_imbalance(cell))
        checked = cell.total("checked_outputs")
        row.append(f"{cell.total('subnormal_outputs'):.0f}" if checked else "-")
        row.append(fill_per_step(cell, figures))
        row.append(slowest_fills(cell, figures))
        ideal = cells.get((case, IDEAL, concurrency))
        if mode == IDEAL:
            row += ["(reference)", "(reference)"]
        else:
            row.append(against_ideal_text(cell, ideal, "median_tpot_ms"))
            row.append(against_ideal_text(cell, ideal, "p99_itl_ms"))
        rows.append(row)
    lines = ["| " + " | ".join(headings) + " |", "|" + "---|" * len(headings)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


BAR = {"median_tpot_ms": ("TPOT p50", 0.02), "p99_itl_ms": ("ITL p99", 0.05)}
"""The differences from the ideal a run is meant to tell apart (the README's
2% / 5% bar): the figure's name, and how far from the ideal still counts as
equal."""


def straddling(cell: Cell, ideal: Cell | None) -> str:
    """The figures of `BAR` whose interval against the ideal reaches both
    inside and outside the bar, said (``ITL p99 -7.0% to +3.8%``; empty where
    none): whatever their estimates read, the run cannot say whether the mode
    is within it. Not a figure without an interval, nor one wholly inside or
    outside (a distortion such as upstream's re-prefills)."""
    found = []
    for key, (figure, bar) in BAR.items():
        ratio = against_the_ideal(cell, ideal, key)
        if ratio is None or ratio.low is None or ratio.high is None:
            continue
        if (
            ratio.low < bar
            and ratio.high > -bar
            and (ratio.low < -bar or ratio.high > bar)
        ):
            found.append(f"{figure} {ratio.low:+.1%} to {ratio.high:+.1%}")
    return ", ".join(found)


def undecided(cells: dict[tuple[str, str, int], Cell]) -> list[str]:
    """A warning, as lines, naming each mode and concurrency with a figure
    `straddling` the bar; no lines where there is none. With each, the
    ideal's own TPOT p50 spread: where the machine's speed moved during the
    run (pairing leg by leg cancels a slow drift, not a spell within a
    leg), every interval of that concurrency widens."""
    lines = []
    for (case, mode, concurrency), cell in cells.items():
        ideal = cells.get((case, IDEAL, concurrency))
        if mode == IDEAL or cell.error or ideal is None:
            continue
        said = straddling(cell, ideal)
        if said:
            lines.append(
                f"  {case} C={concurrency} {mode}: {said} (the "
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
        "speed moved), or with more --rounds or --settle-minutes",
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
            if cell.legs and cell.error is None:
                series.setdefault((case, mode), []).append(
                    (concurrency, cell.figures()[key])
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
