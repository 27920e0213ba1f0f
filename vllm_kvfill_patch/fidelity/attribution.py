"""The verdict by attribution: what the fill itself adds to a mode's decode
figures, measured inside each leg, with no leg-to-leg noise.

The worker records every forward pass and the fill's time within it
(`probe`'s ``steps``). A decode step is what separates two tokens of every
running request, so a leg's ITL percentiles follow its steps' and its TPOT
is their mean: taking each step's fill out of it is the leg again without
the fill. The fill's effect on ITL p99 is the steps' p99 less their p99
with the fill taken out; on TPOT p50, the fill's mean per step; each as a
share of the leg's measured figure, with a 95% interval from resampling the
steps. The legs' own comparison with the reference is the cross-check: the
attribution is consistent with them where their interval holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_kvfill_patch.fidelity.stats import Bar, Ratio, Standing

RESAMPLES = 1000
"""Bootstrap resamples of a cell's steps for the effect's interval."""


@dataclass(frozen=True)
class Effect:
    """What the fill adds to a figure, as a share of it, and its interval."""

    estimate: float
    low: float
    high: float

    def standing(self, tolerance: float) -> Standing:
        if self.high < tolerance:
            return Standing.WITHIN
        if self.low > tolerance:
            return Standing.OUTSIDE
        return Standing.UNDECIDED

    def text(self) -> str:
        return f"{self.estimate:+.2%} [{self.low:+.2%}, {self.high:+.2%}]"

    def consistent(self, measured: Ratio | None) -> bool | None:
        """Whether the legs' interval against the reference holds the effect;
        None where the legs have no interval (too few pairs)."""
        if measured is None or measured.low is None or measured.high is None:
            return None
        return measured.low <= self.estimate <= measured.high


def steps_of(legs: list[dict]) -> np.ndarray:
    """Every step of a cell's legs: rows of (seconds, fill seconds)."""
    steps = [step for leg in legs for step in leg.get("steps", [])]
    return np.asarray(steps, dtype=float).reshape(-1, 2)


def fill_effect(steps: np.ndarray, figure: str, measured_ms: float) -> Effect | None:
    """The fill's share of `figure` (``median_tpot_ms`` or ``p99_itl_ms``,
    measured at `measured_ms` over the legs); None without steps."""
    if len(steps) < 2 or measured_ms <= 0:
        return None
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(steps), size=(RESAMPLES, len(steps)))
    seconds, fills = steps[:, 0], steps[:, 1]
    if figure == "p99_itl_ms":
        effect = np.percentile(seconds, 99) - np.percentile(seconds - fills, 99)
        spread = np.percentile(seconds[draws], 99, axis=1) - np.percentile(
            (seconds - fills)[draws], 99, axis=1
        )
    else:
        effect = fills.mean()
        spread = fills[draws].mean(axis=1)
    low, high = np.percentile(spread, [2.5, 97.5]) * 1000 / measured_ms
    return Effect(float(effect * 1000 / measured_ms), float(low), float(high))


def step_p50_ms(steps: np.ndarray) -> float | None:
    """The median forward pass in the worker, in milliseconds."""
    return float(np.median(steps[:, 0])) * 1000 if len(steps) else None


def fill_share(steps: np.ndarray) -> tuple[float, float] | None:
    """The fill's time per step, p50 and p99, in milliseconds."""
    if not len(steps):
        return None
    p50, p99 = np.percentile(steps[:, 1], [50, 99]) * 1000
    return float(p50), float(p99)


def standing_of(effects: dict[Bar, Effect | None]) -> Standing:
    """Outside where any effect is, within where all are, else undecided."""
    found = [
        effect.standing(bar.tolerance) if effect else Standing.UNDECIDED
        for bar, effect in effects.items()
    ]
    for standing in (Standing.OUTSIDE, Standing.UNDECIDED):
        if standing in found:
            return standing
    return Standing.WITHIN
