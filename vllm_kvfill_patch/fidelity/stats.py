"""How a mode's figures compare with the ideal's, and what that says.

Two intervals, both distribution-free: `paired_ratio` (the median of paired
ratios, for the step-by-step comparison in `values`) and `pooled_ratio` (a
percentile of every leg's requests together against the reference's, with a
paired bootstrap over legs, for `vllm bench serve`'s figures). `Standing`
reads an interval against the bar (`BAR`): inside it, outside it, or
undecided. How wide the intervals come out on a 2-core machine, and why the
legs are paired, is in docs/benchmark.md.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass
from typing import Any

CONFIDENCE = 0.95
MIN_PAIRS = 6
"""Paired legs a comparison with the ideal needs for an interval
(`pooled_ratio`); with fewer, the figure alone."""
RESAMPLES = 2000


@dataclass(frozen=True)
class Bar:
    """A figure of vLLM's result and how far from the ideal still counts as
    equal (the README's bar)."""

    key: str
    """The key of vLLM's result JSON: ``median_tpot_ms``, ``p99_itl_ms``."""
    name: str
    tolerance: float


BAR = (Bar("median_tpot_ms", "TPOT p50", 0.02), Bar("p99_itl_ms", "ITL p99", 0.05))
"""The differences from the ideal a run is meant to tell apart."""


class Standing(enum.Enum):
    """Where an interval against the ideal lies, relative to a bar."""

    WITHIN = "within"
    OUTSIDE = "outside"
    UNDECIDED = "undecided"


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

    def text(self, digits: int = 1) -> str:
        """`+1.2% [-3.4%, +5.6%]`, with the interval's confidence after it
        where too few pairs give 95%; the estimate alone without one."""
        middle = f"{self.estimate:+.{digits}%}"
        if self.low is None or self.high is None:
            return middle
        interval = f"{middle} [{self.low:+.{digits}%}, {self.high:+.{digits}%}]"
        if self.confidence < CONFIDENCE:
            interval += f" ({self.confidence:.0%})"
        return interval

    def standing(self, tolerance: float) -> Standing:
        """Within the bar only where the whole interval is; outside where the
        whole interval is; undecided where it reaches both sides, or where
        there is no interval."""
        if self.low is None or self.high is None:
            return Standing.UNDECIDED
        if -tolerance <= self.low and self.high <= tolerance:
            return Standing.WITHIN
        if self.low > tolerance or self.high < -tolerance:
            return Standing.OUTSIDE
        return Standing.UNDECIDED


def paired_ratio(values: list[float], references: list[float]) -> Ratio:
    """The median of paired ratios, minus one, and an interval of two of the
    ratios' order statistics. The number of ratios below their true median
    is binomial(n, 1/2), so the interval that leaves out the k smallest and
    the k largest misses it with probability 2 P(B <= k); the widest k that
    keeps that at most 5% is taken. Under six pairs even the range cannot,
    and the range is given with its own confidence (75% for three)."""
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
    sides' samples of each drawn pair taken together, the middle 95% of
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
