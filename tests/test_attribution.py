"""The verdict by attribution, without vLLM (the `report` session): what the
fill adds inside the legs, from the worker's steps, against the bar, and
whether the legs agree."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_report import ONES, STEADY, cell
from vllm_kvfill_patch.fidelity.attribution import (
    Effect,
    fill_effect,
    fill_share,
    standing_of,
    steps_of,
)
from vllm_kvfill_patch.fidelity.modes import IDEAL, NODE, PACKAGE
from vllm_kvfill_patch.fidelity.report import (
    Key,
    attribution_lines,
    comma_separated,
    full_records,
    rows,
)
from vllm_kvfill_patch.fidelity.stats import BAR, Ratio, Standing


def steps(count: int, seconds: float, fill: float, slow_every: int = 0) -> list:
    """`count` steps of `seconds` and a fill of `fill` on top; every
    `slow_every`-th fill 25 times longer (a wave of admissions)."""
    fills = [
        fill * (25 if slow_every and i % slow_every == 0 else 1) for i in range(count)
    ]
    return [(seconds + taken, taken) for taken in fills]


def test_a_steady_fill_adds_its_mean_to_tpot_and_itself_to_itl_p99():
    taken = np.asarray(steps(2000, 0.010, 0.0002))
    tpot = fill_effect(taken, "median_tpot_ms", 10.0)
    itl = fill_effect(taken, "p99_itl_ms", 20.0)
    assert tpot is not None and itl is not None
    assert tpot.estimate == pytest.approx(0.02)
    assert itl.estimate == pytest.approx(0.01)
    assert tpot.low == pytest.approx(0.02) and tpot.high == pytest.approx(0.02)


def test_a_fill_in_a_few_steps_moves_the_tail_and_not_the_median():
    taken = np.asarray(steps(2000, 0.010, 0.0002, slow_every=50))
    tpot = fill_effect(taken, "median_tpot_ms", 10.0)
    itl = fill_effect(taken, "p99_itl_ms", 10.0)
    assert tpot is not None and itl is not None
    assert tpot.estimate < 0.03
    assert itl.estimate == pytest.approx(0.5, abs=0.01)
    assert itl.standing(0.05) is Standing.OUTSIDE


def test_no_steps_no_effect():
    assert fill_effect(steps_of([{"steps": []}]), "p99_itl_ms", 10.0) is None
    assert fill_share(steps_of([{}])) is None


def test_the_standing_is_decided_by_the_interval_against_the_bar():
    tolerance = 0.05
    assert Effect(0.01, 0.0, 0.02).standing(tolerance) is Standing.WITHIN
    assert Effect(0.08, 0.06, 0.10).standing(tolerance) is Standing.OUTSIDE
    assert Effect(0.05, 0.03, 0.07).standing(tolerance) is Standing.UNDECIDED
    within, outside = Effect(0.0, 0.0, 0.0), Effect(0.1, 0.1, 0.1)
    assert standing_of({BAR[0]: within, BAR[1]: within}) is Standing.WITHIN
    assert standing_of({BAR[0]: within, BAR[1]: outside}) is Standing.OUTSIDE
    assert standing_of({BAR[0]: within, BAR[1]: None}) is Standing.UNDECIDED


def test_the_legs_agree_where_their_interval_holds_the_effect():
    effect = Effect(0.02, 0.01, 0.03)
    assert effect.consistent(Ratio(0.0, -0.05, 0.05, 0.95, 8))
    assert effect.consistent(Ratio(0.2, 0.1, 0.3, 0.95, 8)) is False
    assert effect.consistent(Ratio(0.02, None, None, 0.5, 1)) is None
    assert effect.consistent(None) is None


def test_the_verdict_by_attribution_says_the_word_the_figures_and_the_legs():
    package = cell(STEADY, STEADY, fill_ms=0.2)
    for leg in package.legs:
        leg["steps"] = steps(500, 0.010, 0.00005)
    ideal = cell(ONES, ONES)
    for leg in ideal.legs:
        leg["steps"] = steps(500, 0.010, 0.000001)
    cells = {
        Key("main", 8, IDEAL.name): ideal,
        Key("main", 8, PACKAGE.name): package,
        Key("main", 8, NODE.name): cell(ONES, ONES),
    }
    found, _ = rows(cells)
    lines = attribution_lines(found)
    assert lines[0].startswith("Verdict by attribution: the fill's own time")
    assert lines[1] == "  main C=8:"
    said = lines[2]
    assert said.startswith("    package within the bar of ideal: its fill adds TPOT")
    assert "TPOT p50 +0.50% [+0.50%, +0.50%]" in said
    assert "fill p50 0.050 ms, p99 0.050 ms a step" in said
    assert said.endswith(": consistent")
    assert len(lines) == 3  # the node and the ideal are references
    records = full_records(found)
    assert records[-1]["p99_itl_ms_fill_effect"] is not None
    assert comma_separated(records).count("\n") == 1 + len(records)


def test_without_steps_the_legs_decide_and_say_so():
    cells = {
        Key("main", 1, IDEAL.name): cell(ONES, ONES),
        Key("main", 1, PACKAGE.name): cell(STEADY, STEADY, fill_ms=0.2),
    }
    found, _ = rows(cells)
    said = attribution_lines(found)[2]
    assert said.startswith("    package: no steps recorded; by the legs, package ")
