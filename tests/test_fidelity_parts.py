"""The fidelity tool's parts that need neither vLLM nor a server (the
`report` session): its two layers and what they share, the probe's control
channel, where the tool puts processes, and when a leg is taken again. Its
runs against real servers: tests/engine/test_fidelity.py."""

from __future__ import annotations

import ast
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vllm_kvfill_patch.fidelity import probe
from vllm_kvfill_patch.fidelity.client import read_in_bursts, rerun_reason
from vllm_kvfill_patch.fidelity.cores import (
    FRONT_PRIORITY,
    LOWERED_NICENESS,
    Placement,
    measuring,
)
from vllm_kvfill_patch.fidelity.modes import IDEAL, PACKAGE, UPSTREAM
from vllm_kvfill_patch.fidelity.serve import SITE, ask, mismatch
from vllm_kvfill_patch.fidelity.wire import (
    COUNTS,
    DIR_ENV,
    Answer,
    Setting,
    question_line,
    read_question,
)

FIDELITY = "vllm_kvfill_patch.fidelity"
FIDELITY_DIR = Path(__file__).resolve().parent.parent / Path(*FIDELITY.split("."))
IN_SERVER = {"probe", "switch", "connector", "nixl_rest"}
"""What runs inside `vllm serve`: the tool starts it there by name (its
`sitecustomize`, `kv_connector_module_path`), never by importing it."""
SHARED = "wire"
"""The one module both layers import."""


def fidelity_imports(source: str) -> set[str]:
    """The fidelity modules a module of the tool imports, by short name,
    wherever the import statement is (a function's body too); relative
    imports are read from the tool's package."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = FIDELITY.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if name.startswith(f"{FIDELITY}."):
                found.add(name.removeprefix(f"{FIDELITY}.").split(".")[0])
    return found


def layer_crossings() -> list[str]:
    """Each import of the tool that crosses between its layers other than
    through `SHARED`, as "importer imports imported"."""
    crossings = []
    for path in sorted(FIDELITY_DIR.glob("*.py")):
        importer = path.stem
        for imported in sorted(fidelity_imports(path.read_text())):
            if importer == SHARED:
                allowed = False  # it imports neither layer
            elif importer in IN_SERVER:
                allowed = imported in IN_SERVER or imported == SHARED
            else:
                allowed = imported not in IN_SERVER
            if not allowed:
                crossings.append(f"{importer} imports {imported}")
    return crossings


def test_what_runs_inside_vllm_serve_and_what_drives_it_meet_only_in_the_wire():
    assert (FIDELITY_DIR / f"{SHARED}.py").exists()
    assert {f"{name}.py" for name in IN_SERVER} <= {
        path.name for path in FIDELITY_DIR.glob("*.py")
    }
    assert layer_crossings() == []


def test_the_layer_check_finds_every_form_of_import():
    source = (
        "from vllm_kvfill_patch.fidelity import probe, wire\n"
        "import vllm_kvfill_patch.fidelity.switch as switched\n"
        "from vllm_kvfill_patch import options\n"
        "def later():\n"
        "    from .connector import SwitchedDecodeBenchConnector\n"
        "    from . import serve\n"
        "    from vllm_kvfill_patch.fidelity.cores import Placement\n"
    )
    assert fidelity_imports(source) == {
        "probe", "wire", "switch", "connector", "serve", "cores",
    }  # fmt: skip
    # The tool starts the probe by name, in a string: not an import.
    assert fidelity_imports(f"SITE = {SITE!r}\n") == set()


def test_a_setting_crosses_the_control_channel_and_each_process_is_checked():
    for setting in (UPSTREAM.setting, PACKAGE.setting, IDEAL.setting):
        assert setting is not None
        assert Setting.decoded(setting.encoded()) == setting
        assert " " not in setting.encoded()
        line = question_line(3, setting)
        assert line.endswith("\n") and line.count("\n") == 1
        assert read_question(line.strip()) == (3, setting.encoded())
    assert read_question(question_line(4).strip()) == (4, "")
    ideal = IDEAL.setting
    assert ideal is not None
    state = {"decision": "applied", "writes": False, "refill": [False]}
    assert mismatch(ideal, state) is None
    wrong = {"decision": "reverted", "writes": True, "refill": [True]}
    assert mismatch(ideal, wrong) == (
        "decision reverted, not applied; writes True, not False; "
        "refill [True], not False"
    )
    assert mismatch(ideal, {"skipped": "no connector in this process"}) is None
    linked = dataclasses.replace(PACKAGE.setting, link=(50.0, None))
    state = {"decision": "applied", "writes": True, "refill": [False]}
    assert mismatch(linked, state | {"link": [[50.0, None, "fifo"]]}) is None
    assert mismatch(linked, state | {"link": [None]}) == (
        "link [None], not [50.0, None, 'fifo']"
    )
    assert mismatch(linked, state | {"link": [[50.0, None, "fair"]]}) == (
        "link [[50.0, None, 'fair']], not [50.0, None, 'fifo']"
    )
    assert mismatch(PACKAGE.setting, state | {"link": [[50.0, None, "fifo"]]}) == (
        "link [[50.0, None, 'fifo']], not None"
    )


def test_a_probes_answer_holds_every_counter_the_tool_reads(tmp_path):
    answer = probe.Counters(tmp_path).snapshot(5)
    assert set(answer) == Answer.__required_keys__
    assert set(COUNTS) <= set(answer)
    assert answer["answered"] == 5
    assert answer["placement"]["process"]


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
    env = {**os.environ, DIR_ENV: str(tmp_path)}
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
        ask(tmp_path, 1)
        answer = json.loads(saved.read_text())
        assert (answer["answered"], answer["fill_calls"]) == (1, 7)
        assert answer["placement"]["cores"] == sorted(
            os.sched_getaffinity(counting.pid)
        )
        counting.kill()
        counting.wait()
        # Its forked child lives on, but has closed the FIFO: no reader.
        asked = time.monotonic()
        ask(tmp_path, 2)
        assert time.monotonic() - asked < 1
        assert json.loads(saved.read_text())["answered"] == 1
    finally:
        os.killpg(counting.pid, signal.SIGKILL)
        counting.wait()


def test_a_process_bound_to_fewer_cores_keeps_them_and_the_rest_move_off(tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "this test needs two cores"
    # An API server's stand-in that starts two more processes, as vLLM's
    # starts its engine core and worker.
    tree = (
        "import subprocess, sys, threading, time\n"
        "children = [subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(120)']) for _ in range(2)]\n"
        "threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
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
        # Root here, as in CI: the API server's threads may go first.
        assert placement.first, "real-time scheduling is not permitted here"
        assert sorted(placement.apply(leader.pid)) == [engine]
        for pid, on, niceness, policy in (
            (leader.pid, cores[1:], 0, os.SCHED_RR),
            (engine, cores[1:], LOWERED_NICENESS, os.SCHED_OTHER),
            (worker, cores[:1], 0, os.SCHED_OTHER),
        ):
            threads = [int(thread) for thread in os.listdir(f"/proc/{pid}/task")]
            assert len(threads) == (2 if pid == leader.pid else 1)
            for thread in threads:
                assert sorted(os.sched_getaffinity(thread)) == on, pid
                assert os.getpriority(os.PRIO_PROCESS, thread) == niceness
                assert os.sched_getscheduler(thread) == policy, pid
            if policy == os.SCHED_RR:
                assert os.sched_getparam(pid).sched_priority == FRONT_PRIORITY
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def test_vllms_client_measures_first_on_the_front_without_the_garbage_collector():
    before = os.sched_getaffinity(0)
    one = frozenset({min(before)})
    with measuring(Placement((), frozenset(), one, first=True)):
        assert os.sched_getaffinity(0) == one
        assert os.sched_getscheduler(0) == os.SCHED_RR
        assert not gc.isenabled()
    assert os.sched_getaffinity(0) == before
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert gc.isenabled()
    with measuring(Placement((), frozenset(), one)):
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    with measuring(None):
        assert os.sched_getaffinity(0) == before
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_leg_read_in_bursts_or_with_lost_requests_is_taken_again():
    per_leg, output = 4, 16
    streamed = {
        "num_prompts": per_leg,
        "completed": per_leg,
        "itls": [[0.01] * (output - 1)] * per_leg,
    }
    assert read_in_bursts(streamed) == 0 and rerun_reason(streamed) is None
    # A client kept off the CPU reads a whole output at once: ITLs of 0.
    one_burst = [[0.0] * (output - 2) + [0.6]] + streamed["itls"][1:]
    reason = rerun_reason({**streamed, "itls": one_burst})
    assert reason is not None and "read 1 requests' tokens in bursts" in reason
    lost = "Traceback (most recent call last):\n  ...\nServerDisconnectedError: gone\n"
    failed = {**streamed, "completed": per_leg - 1, "errors": ["", lost]}
    assert rerun_reason(failed) == (
        f"1 of {per_leg} requests failed: ServerDisconnectedError: gone"
    )


def test_the_probe_times_each_requests_admission_and_wait_for_kv(tmp_path):
    """What the scheduler process records after each ``schedule()`` (a
    scheduler of the fields it reads): a request's delay from its arrival to
    its admission, once, and its wait for its KV, from the step that
    admitted it to the step that scheduled it; each handed out once."""
    from types import SimpleNamespace

    counters = probe.Counters(tmp_path)
    request = SimpleNamespace(
        status=SimpleNamespace(name="WAITING_FOR_REMOTE_KVS"),
        arrival_time=time.time() - 0.5,
    )
    scheduler = SimpleNamespace(requests={"r": request})
    counters.note_kv_waits(scheduler, {})
    assert 0.5 <= counters.admissions[0] < 5 and not counters.kv_waits
    time.sleep(0.01)
    request.status = SimpleNamespace(name="RUNNING")
    counters.note_kv_waits(scheduler, {"r": 1})
    assert len(counters.admissions) == 1 and 0.01 <= counters.kv_waits[0] < 5
    answer = counters.snapshot(1)
    assert (len(answer["admissions"]), len(answer["kv_waits"])) == (1, 1)
    assert counters.snapshot(2)["kv_waits"] == []
    scheduler.requests.clear()  # finished: forgotten
    counters.note_kv_waits(scheduler, {})
    assert not counters.admitted and not counters.waiting_since


def test_the_probe_times_each_requests_first_token_once(tmp_path):
    """What the scheduler process records after each output it takes: a
    request's id, arrival and first sampled token (wall clock), once (not
    at its later tokens, not for a request that sampled none), handed out
    once; forgotten when it finishes."""
    from types import SimpleNamespace

    counters = probe.Counters(tmp_path)
    counters.admitted = {"a", "b"}
    arrivals = {"a": time.time() - 0.25, "b": time.time()}
    first = SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[[7], []])
    counters.note_first_tokens(arrivals, first)
    ((named, arrival, token),) = counters.first_tokens
    assert (named, arrival) == ("a", arrivals["a"])
    assert 0.25 <= token - arrival < 5 and token <= time.time()
    later = SimpleNamespace(req_ids=["a", "b"], sampled_token_ids=[[8], [9]])
    counters.note_first_tokens(arrivals, later)
    named, arrival, token = counters.first_tokens[1]
    assert named == "b" and token - arrival < 0.25
    assert len(counters.snapshot(1)["first_tokens"]) == 2
    assert counters.snapshot(2)["first_tokens"] == []
    counters.admitted = set()  # finished
    counters.note_first_tokens(arrivals, SimpleNamespace(req_ids=[]))
    assert not counters.first_token_seen
