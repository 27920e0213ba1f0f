"""The fidelity tool's statistics, plan, arguments and report, without vLLM
(the `report` session): what it concludes from given figures, and what it
writes. Its other vLLM-free parts: tests/test_fidelity_parts.py; its runs
against real servers: tests/engine/test_fidelity.py."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import random

import numpy as np
import pytest

from vllm_kvfill_patch.fidelity.args import parse
from vllm_kvfill_patch.fidelity.modes import IDEAL, PACKAGE, UPSTREAM
from vllm_kvfill_patch.fidelity.picture import draw
from vllm_kvfill_patch.fidelity.plan import QUICK, THOROUGH, Plan, in_turn
from vllm_kvfill_patch.fidelity.report import (
    TERMINAL_HEADINGS,
    Cell,
    Key,
    against,
    comma_separated,
    fill_p99_ms,
    full_records,
    markdown,
    metric_of,
    preemption_finding,
    rows,
    terminal_table,
    verdict_lines,
)
from vllm_kvfill_patch.fidelity.stats import (
    Ratio,
    Standing,
    paired_ratio,
    pooled_ratio,
)
from vllm_kvfill_patch.fidelity.wire import FILL_BUCKETS, Setting, fill_bucket


def synthetic_legs(tpot: list[float], itl: list[float], requests: int = 10) -> list:
    """Legs of two per round whose requests all have TPOT `tpot[i]` x 10 ms
    and ITLs `itl[i]` x 20 ms in leg i, as vLLM's result holds them."""
    output = 5
    return [
        {
            "round": i // 2, "leg": i % 2, "num_prompts": requests,
            "completed": requests, "failed": 0, "duration": 1.0,
            "total_input_tokens": requests, "total_output_tokens": requests * output,
            "max_output_tokens_per_s": 1.0, "max_concurrent_requests": requests,
            "p99_itl_ms": 0.0, "p99_tpot_ms": 0.0,  # vLLM's percentiles asked for
            "ttfts": [0.05] * requests,
            "latencies": [0.05 + 0.010 * tpot_factor * (output - 1)] * requests,
            "output_lens": [output] * requests,
            "itls": [[0.020 * itl_factor] * (output - 1)] * requests,
        }
        for i, (tpot_factor, itl_factor) in enumerate(zip(tpot, itl, strict=True))
    ]  # fmt: skip


def cell(tpot: list[float], itl: list[float], fill_ms: float = 0.0, **totals) -> Cell:
    """A cell of synthetic legs, one round of counters with `totals`."""
    histogram = [0] * FILL_BUCKETS
    if fill_ms:
        histogram[fill_bucket(fill_ms / 1000)] = 100
    run = {
        "fill_histogram": histogram, "fill_calls": 100 if fill_ms else 0,
        "fill_seconds": fill_ms / 10, "median_tpot_ms": 10.0, "preemptions": 0,
        "reprefilled_tokens": 0, "read_in_bursts": 0, "expert_forwards": 0,
        "expert_imbalance_sum": 0.0, "subnormal_outputs": 0, **totals,
    }  # fmt: skip
    return Cell(runs=[run], legs=synthetic_legs(tpot, itl))


STEADY = [1.0, 1.005, 0.995, 1.0, 1.01, 0.99, 1.0, 1.0]
SPREAD = [0.9, 0.95, 0.97, 1.0, 1.0, 1.03, 1.05, 1.1]
ONES = [1.0] * 8


def test_the_paired_interval_holds_the_median_in_95_percent_of_runs():
    # Pairs of a skewed distribution whose median ratio is known: +10%.
    rng = random.Random(0)
    for pairs in (6, 9, 20, 60):
        held = 0
        for _ in range(2000):
            values = [1.1 * rng.lognormvariate(0, 0.2) for _ in range(pairs)]
            ratio = paired_ratio(values, [1.0] * pairs)
            held += ratio.low <= 0.1 <= ratio.high
        assert ratio.confidence >= 0.95
        assert 0.95 - 0.015 <= held / 2000 <= ratio.confidence + 0.015, pairs
    # Too few pairs for 95%: the range, and what it holds.
    three = paired_ratio([1.3, 0.9, 1.1], [1.0] * 3)
    assert [three.low, three.high, three.confidence] == pytest.approx([-0.1, 0.3, 0.75])
    assert three.text(0) == "+10% [-10%, +30%] (75%)"
    assert paired_ratio([1.05], [1.0]).text(1) == "+5.0%"


def test_the_pooled_interval_holds_the_true_ratio_in_about_95_percent_of_runs():
    # Legs of skewed samples, each pair slowed alike by a spell of the
    # machine; the cell's samples are 3% above the reference's.
    rng = np.random.default_rng(0)
    for percentile, pairs in ((99, 12), (50, 6)):
        held, runs = 0, 200
        for _ in range(runs):
            spells = rng.lognormal(0, 0.1, pairs)
            ours, reference = (
                [list(f * s * rng.lognormal(0, 0.3, 150)) for s in spells]
                for f in (1.03, 1.0)
            )
            ratio = pooled_ratio(ours, reference, percentile, resamples=300)
            held += ratio.low <= 0.03 <= ratio.high
        assert 0.88 <= held / runs <= 0.99, (percentile, pairs, held)


def test_an_interval_is_within_outside_or_undecided_against_the_bar():
    def standing(low, high):
        return Ratio(0.0, low, high, 0.95, 8).standing(0.05)

    assert standing(-0.04, 0.05) is Standing.WITHIN
    assert standing(0.06, 0.2) is Standing.OUTSIDE
    assert standing(-0.3, -0.051) is Standing.OUTSIDE
    assert standing(-0.01, 0.07) is Standing.UNDECIDED
    assert standing(-0.1, 0.1) is Standing.UNDECIDED
    # Without an interval, nothing is decided.
    assert Ratio(0.0, None, None, 0.0, 3).standing(0.05) is Standing.UNDECIDED


def test_against_the_reference_a_figure_is_over_every_legs_requests_paired_by_leg():
    ideal = Cell(legs=synthetic_legs(ONES, ONES))
    # One leg at +40%: the pooled median does not move, the p99 does.
    ours = Cell(legs=synthetic_legs([1.0] * 7 + [1.4], [1.0] * 7 + [1.4]))
    tpot = against(ours, ideal, "median_tpot_ms")
    itl = against(ours, ideal, "p99_itl_ms")
    assert tpot.estimate == pytest.approx(0.0, abs=1e-12)
    assert itl.estimate == pytest.approx(0.4)
    assert tpot.pairs == itl.pairs == 8
    # Drawn without that leg now and then: the p99's interval spans both.
    assert itl.low == pytest.approx(0.0, abs=1e-12) and itl.high == pytest.approx(0.4)
    # Legs the reference did not run are not compared; too few pairs: no interval.
    assert against(ours, Cell(legs=ideal.legs[:5]), "p99_itl_ms").text() == "+0.0%"
    assert against(ours, Cell(error="did not start"), "p99_itl_ms") is None
    assert metric_of("median_ttft_ms") == ("ttft", 50.0)
    with pytest.raises(ValueError, match="mean_itl_ms"):
        metric_of("mean_itl_ms")


def verdict_cells() -> dict[Key, Cell]:
    return {
        Key("main", 1, IDEAL.name): cell(ONES, ONES),
        Key("main", 1, PACKAGE.name): cell(STEADY, STEADY, fill_ms=0.2),
        Key("main", 1, UPSTREAM.name): cell(ONES, [1.3, 1.4] * 4, fill_ms=2.0),
        Key("main", 8, IDEAL.name): cell(ONES, ONES),
        Key("main", 8, PACKAGE.name): cell(SPREAD, STEADY, fill_ms=0.2),
        Key("main", 8, UPSTREAM.name): Cell(error="vllm bench serve failed: gone"),
    }


def test_the_verdict_says_per_concurrency_within_outside_by_how_much_or_undecided():
    found, failed = rows(verdict_cells())
    lines = verdict_lines(found)
    assert lines[0] == (
        "The legs against the ideal (TPOT p50 ±2%, ITL p99 ±5%; 95% intervals):"
    )
    c1, c8 = lines[1:]
    assert c1.startswith(
        "  main C=1: package within the bar of ideal (TPOT p50 +0.0% ["
    ), c1
    assert (
        "; upstream outside the bar of ideal by ITL p99 +40.0% [+40.0%, +40.0%]" in c1
    )
    assert "TPOT p50" not in c1.split("; upstream")[1]  # inside: not said
    assert c8.startswith("  main C=8: package undecided on this machine (TPOT p50 ")
    assert "ITL p99" not in c8  # inside the bar: only the undecided figure
    assert failed == {Key("main", 8, "upstream"): "vllm bench serve failed: gone"}


def test_the_terminal_table_has_ten_columns_at_most_and_names_what_did_not_run():
    found, failed = rows(verdict_cells())
    table = terminal_table(found, failed, "main").splitlines()
    assert len(TERMINAL_HEADINGS) <= 10
    assert table[0] == "| " + " | ".join(TERMINAL_HEADINGS) + " |"
    modes = [line.split(" | ")[0].removeprefix("| ") for line in table[2:]]
    assert modes == ["upstream", "package", "ideal", "package", "ideal", "upstream"]
    ideal = table[4].split(" | ")
    assert ideal[3] == ideal[5] == "(reference)"
    upstream = table[2].split(" | ")
    assert upstream[5] == "+40.0% [+40.0%, +40.0%]"
    # The fill's p99 (2.0 ms, read from buckets 1% apart) against ITL p99.
    assert upstream[6] == "2.008 ms (7.2%)"
    assert table[-1] == "| upstream | 8 | did not run: vllm bench serve failed: gone |"


def test_the_full_table_is_written_as_markdown_csv_and_json_alike():
    found, _ = rows(verdict_cells())
    records = full_records(found)
    assert [(r["mode"], r["concurrency"]) for r in records] == [
        ("upstream", 1), ("package", 1), ("ideal", 1), ("package", 8), ("ideal", 8),
    ]  # fmt: skip
    parsed = list(csv.DictReader(io.StringIO(comma_separated(records))))
    assert [row["mode"] for row in parsed] == [r["mode"] for r in records]
    assert json.loads(json.dumps(records)) == records
    upstream = records[0]
    assert upstream["p99_itl_ms_vs_reference"] == pytest.approx(0.4)
    assert upstream["standing"] == "outside" and records[2]["standing"] is None
    lines = markdown(records).splitlines()
    assert len(lines) == 2 + len(records)
    assert lines[0].count(" | ") == len(records[0]) - 1


def test_preemption_is_said_in_plain_words_when_any_mode_preempted():
    cells = verdict_cells()
    assert preemption_finding(rows(cells)[0]) == []
    cells[Key("preemption", 8, "ideal")] = cell(
        ONES, ONES, preemptions=5, reprefilled_tokens=2600
    )
    cells[Key("preemption", 8, "package")] = cell(
        ONES, ONES, preemptions=4, reprefilled_tokens=2100
    )
    lines = preemption_finding(rows(cells)[0])
    assert lines == [
        "Preemption: vLLM preempted requests, and recomputed them when they resumed:",
        "  preemption C=8: package 4 requests, 2100 tokens recomputed, ideal 5 "
        "requests, 2600 tokens recomputed",
        "A decode node at this concurrency and KV cache size would do the same "
        "(it takes a request's KV once). To measure steady decode, lower the "
        "concurrency or raise the KV cache memory.",
    ]


def test_the_picture_is_drawn(tmp_path):
    try:
        import matplotlib  # noqa: F401 - the report lock installs it
    except ImportError as exc:
        pytest.fail(
            f"the picture needs matplotlib ({exc!r}); build the environment "
            "with: python3 -m nox -s report",
            pytrace=False,
        )
    found, _ = rows(verdict_cells())
    drawn = draw(found, tmp_path / "decode.png", "synthetic")
    assert drawn == str(tmp_path / "decode.png")
    assert (tmp_path / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_default_is_quick_and_thorough_is_one_flag():
    quick, thorough = Plan.of(parse([])), Plan.of(parse(["--thorough"]))
    assert (quick.rounds, quick.settle_minutes, quick.value_cycles) == (2, 0, 0)
    assert (thorough.rounds, thorough.settle_minutes) == (6, 15)
    assert thorough.value_cycles == THOROUGH.value_cycles
    # Output 64: whole waves enough for the profile's decode steps.
    assert quick.main.waves == -(-QUICK.steps_per_run // 63)
    assert [quick.main.leg_prompts(c) for c in (1, 8)] == [[2] * 4, [16] * 4]
    assert Plan.of(parse(["--rounds", "3", "--thorough"])).rounds == 3
    # One connector server for upstream, the package (without and with the
    # link model) and the ideal; real prefill apart; the refill pair only
    # when asked. The link is the real node's, known once it is measured.
    assert [m.name for m in quick.main.modes] == [
        "upstream",
        "package",
        "package+link",
        "ideal",
        "ideal+link",
    ]
    assert [m.setting.link for m in quick.main.modes if m.setting] == [None] * 5
    assert quick.prefill is not None and quick.prefill.modes[0].setting is None
    refill = Plan.of(parse(["--refill"]))
    assert [m.name for m in refill.main.modes][-2:] == [
        "package+refill",
        "ideal+refill",
    ]
    # The embedded model preempts in a case of its own; a user's model only
    # when asked.
    assert quick.preemption is not None and quick.preemption.legs == 4
    assert not [m.name for m in quick.preemption.modes if m.linked]
    assert Plan.of(parse(["--model", "m"])).preemption is None


def test_each_leg_is_warmed_up_by_one_request_unless_told_otherwise(capsys):
    assert parse([]).warm_ups == 1
    assert parse(["--warm-ups", "0"]).warm_ups == 0
    with pytest.raises(SystemExit):
        parse(["--warm-ups", "-1"])
    assert "--warm-ups takes 0 or more requests, not -1" in capsys.readouterr().err


def test_the_link_mode_crosses_the_link_given_or_fitted_to_the_node():
    given = Plan.of(parse(["--link", "50,0.25"]))
    linked, ideal = [m for m in given.main.modes if m.linked]
    assert linked.setting.link == ideal.setting.link == (50.0, 0.25)
    assert (linked.reference, ideal.setting.writes) == ("ideal+link", False)
    assert linked.setting.encoded() == "package=1,writes=1,refill=0,link=50.0:0.25:fifo"
    assert Setting.decoded(linked.setting.encoded()) == linked.setting
    word = "package=1,writes=1,refill=0,link=7.5::fair"
    assert Setting.decoded(word).link == (7.5, None)
    shared = Plan.of(parse(["--link", "50,0.25", "--link-sharing", "fair"]))
    assert {m.setting.sharing for m in shared.main.modes if m.linked} == {"fair"}
    unlinked = [m for m in given.main.modes if not m.linked and m.setting]
    assert all(m.setting.link is None for m in unlinked)
    with pytest.raises(SystemExit):  # no node to fit it to, none given
        parse(["--modes", "package", "package+link", "ideal"])
    with pytest.raises(SystemExit):
        parse(["--link", "-1,2"])


def test_the_modes_take_turns_leg_by_leg_rotated():
    modes = (UPSTREAM, PACKAGE, IDEAL)
    firsts = [in_turn(modes, 0, leg, 4)[0].name for leg in range(4)]
    assert firsts == ["upstream", "package", "ideal", "upstream"]
    assert in_turn(modes, 1, 0, 4)[0].name == "package"  # round 1 goes on


def test_every_option_has_help_in_a_group_with_its_default_shown():
    parser = argparse.ArgumentParser()
    import vllm_kvfill_patch.fidelity.args as module

    for add in (module.add_serving, module.add_workload, module.add_length,
                module.add_extras):  # fmt: skip
        add(parser.add_argument_group(add.__name__))
    options = [a for a in parser._actions if a.option_strings != ["-h", "--help"]]
    assert all(action.help for action in options)
    helped = module.HelpFormatter("prog")
    said = {a.dest: helped._get_help_string(a) for a in options}
    assert said["legs"].endswith("(default: %(default)s)")
    assert "(default: 2; 6 with --thorough)" in said["rounds"]
    assert "%(default)" not in said["rounds"]


def test_every_option_of_the_values_command_has_help_in_a_group_with_its_default():
    from vllm_kvfill_patch.fidelity.values import parser

    built = parser()
    titles = {a.dest: g.title for g in built._action_groups for a in g._group_actions}
    options = [a for a in built._actions if a.option_strings != ["-h", "--help"]]
    assert all(action.help for action in options)
    assert {titles[a.dest] for a in options} == {"what is measured", "files"}
    helped = built._get_formatter()
    said = {a.dest: helped._get_help_string(a) for a in options}
    for shown in ("concurrency", "input_len", "cycles", "fill_config"):
        assert said[shown].endswith("(default: %(default)s)"), shown
    for unset in ("model_dir", "output"):  # None: the help says what happens
        assert "%(default)" not in said[unset] and "default: " in said[unset]


def test_settling_adds_rounds_of_the_package_and_the_ideal_where_undecided(
    tmp_path, capsys
):
    from vllm_kvfill_patch.fidelity.__main__ import Run

    run = Run(["--model", "m", "--output-dir", str(tmp_path), "--concurrency", "1",
               "8", "--thorough"])  # fmt: skip
    assert run.plan.settle_minutes == 15
    run.measurer.cells = {
        Key("main", 1, "ideal"): cell(ONES, ONES),
        Key("main", 1, "package"): cell(STEADY, STEADY),
        Key("main", 8, "ideal"): cell(ONES, ONES),
        Key("main", 8, "package"): cell(SPREAD, STEADY),
    }
    measured = []

    def round_(server, case, number):
        measured.append(([m.name for m in case.modes], case.concurrencies, number))
        # Rounds that agree with the ideal: the interval narrows into the bar.
        for mode in case.modes:
            legs = synthetic_legs([1.0] * 40, [1.0] * 40)
            for leg in legs:
                leg["round"] += number
            run.measurer.cells[Key("main", 8, mode.name)].legs += legs

    run.measurer.round = round_
    run.settle(None, run.plan.main, 6, 5)
    # Only C = 8 was undecided; upstream is not measured again.
    assert measured == [(["package", "ideal"], (8,), 6)]
    said = capsys.readouterr().out
    assert "settle: the package undecided at C=(8,); round 7" in said
    assert "settle: 1 more rounds" in said
    # Without the package or the ideal, nothing is added.
    measured.clear()
    run.measurer.cells[Key("main", 8, "package")] = cell(SPREAD, STEADY)
    without = dataclasses.replace(run.plan.main, modes=(UPSTREAM, PACKAGE))
    run.settle(None, without, 6, 5)
    assert measured == []


def test_a_fill_p99_is_read_within_one_percent_of_the_true_one():
    """Fills of 11.2 and 11.585 ms (3.4% apart, one bucket of the old
    quarter-octave histogram) print apart, each within 1% above its true
    time."""
    printed = [fill_p99_ms(cell(ONES, ONES, fill_ms=ms)) for ms in (11.2, 11.585)]
    assert printed[0] != printed[1]
    for true, read in zip((11.2, 11.585), printed, strict=True):
        assert true <= read <= true * 1.01
