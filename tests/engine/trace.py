"""What each process of a topology did, recorded from inside it.

vLLM's data-parallel ranks, pipeline stages and `vllm serve` start their own
processes, out of a test's reach. `topology_env` gives them this directory's
``site/sitecustomize.py``, which calls `start` at interpreter start; each
process then appends JSON lines to ``<KVFILL_TRACE_DIR>/<pid>.jsonl``:

- ``start``: every Python process;
- ``connector``: it imported DecodeBenchConnector's module, and whether this
  package was loaded by then;
- ``built``: it built a DecodeBenchConnector (its role: scheduler or
  worker), the processes where the connector runs;
- ``fill``: each step's fill, checked as ``engine_probe.install_spy`` checks
  it (the spy goes in at the first step, above whatever wraps the step then);
- ``schedule``: each scheduler step (tokens per request, preemptions).

Only the standard library and wrapt are imported at start: nothing of vLLM
before vLLM imports it, and no package import order changes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

TRACE_DIR = "KVFILL_TRACE_DIR"
SITE = Path(__file__).with_name("site")
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector"
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


def topology_env(trace_dir: Path, env: dict | None = None) -> dict:
    """`env` for a topology's processes: traced into `trace_dir`."""
    from tests.helpers import ROOT

    trace_dir.mkdir(parents=True, exist_ok=True)
    env = dict(env or {})
    inherited = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), str(ROOT), inherited]))
    env[TRACE_DIR] = str(trace_dir)
    return env


def start() -> None:
    import wrapt

    record({"event": "start", "argv": sys.argv[:2]})
    wrapt.register_post_import_hook(_on_connector, CONNECTOR_MODULE)
    wrapt.register_post_import_hook(_on_scheduler, SCHEDULER_MODULE)


def record(entry: dict) -> None:
    entry = {
        "pid": os.getpid(),
        "name": multiprocessing.current_process().name,
        **entry,
    }
    path = Path(os.environ[TRACE_DIR], f"{os.getpid()}.jsonl")
    with path.open("a") as out:
        out.write(json.dumps(entry) + "\n")


def _on_connector(module) -> None:
    import wrapt

    from tests.engine import engine_probe

    record({"event": "connector", "package_loaded": "vllm_kvfill_patch" in sys.modules})

    def at_first_step(wrapped, instance, args, kwargs):
        if not engine_probe.SPIES:
            engine_probe.install_spy(lambda fill: record({"event": "fill", **fill}))
        return wrapped(*args, **kwargs)

    def built(wrapped, instance, args, kwargs):
        role = args[1] if len(args) > 1 else kwargs.get("role")
        record({"event": "built", "role": getattr(role, "name", str(role))})
        return wrapped(*args, **kwargs)

    # The worker binds each step's metadata just before the step.
    wrapt.wrap_function_wrapper(
        module, "DecodeBenchConnector.bind_connector_metadata", at_first_step
    )
    wrapt.wrap_function_wrapper(module, "DecodeBenchConnector.__init__", built)


def _on_scheduler(module) -> None:
    from tests.engine import engine_probe

    engine_probe.record_schedules(lambda step: record({"event": "schedule", **step}))


class Trace:
    """What the processes traced into a directory did, by pid."""

    def __init__(self, trace_dir: Path) -> None:
        self.events: dict[int, list[dict]] = defaultdict(list)
        for path in trace_dir.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                self.events[entry["pid"]].append(entry)

    def pids(self, event: str) -> set[int]:
        return {
            pid
            for pid, entries in self.events.items()
            if any(e["event"] == event for e in entries)
        }

    def roles(self) -> dict[str, int]:
        """How many processes built the connector in each role."""
        counts: dict[str, int] = defaultdict(int)
        for entries in self.events.values():
            for role in {e["role"] for e in entries if e["event"] == "built"}:
                counts[role] += 1
        return dict(counts)

    def of(self, pid: int, event: str) -> list[dict]:
        return [e for e in self.events[pid] if e["event"] == event]


DECISION = re.compile(
    r"vllm-kvfill-patch (\w+) for vLLM .*\[process \S+, pid (\d+), host"
)


def decisions(log: str) -> dict[int, str]:
    """The patch's decision each process logged, by the pid its line names."""
    return {int(pid): decision for decision, pid in DECISION.findall(log)}
