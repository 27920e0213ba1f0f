"""Rounds of a case against a running server: each leg's `vllm bench serve`,
the modes in turn leg by leg (switched in place between legs), legs taken
again where their figures are not the server's, each round recorded."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_kvfill_patch.fidelity.client import (
    Workload,
    bench,
    combined,
    failed_requests,
    read_in_bursts,
    rerun_reason,
    slim,
    warm_up,
)
from vllm_kvfill_patch.fidelity.cores import Placement, measuring
from vllm_kvfill_patch.fidelity.modes import Mode
from vllm_kvfill_patch.fidelity.plan import Case, in_turn
from vllm_kvfill_patch.fidelity.report import Cell, Key
from vllm_kvfill_patch.fidelity.serve import Server, logged_exception
from vllm_kvfill_patch.fidelity.wire import COUNTS, REQUEST_LISTS, counted

IDLE_SPIN_SECONDS = 1.0
"""vLLM's engine core and worker spin-wait this long after their last
message (`shm_broadcast`'s `busy_loop_s`): a leg's warm-up starts that long
after whatever ran before it, and the leg itself at once after its warm-up."""
WARM_UP_SEEDS = 1_000_000
"""Added to a leg's seed for its warm-up's: prompts no leg sends."""
RERUNS = 2
"""A leg whose figures are not the server's (`client.rerun_reason`) is taken
again up to this many times; the last one's figures stand."""


@dataclass(frozen=True)
class Leg:
    """One run of `vllm bench serve`: a mode's share of a round."""

    case: Case
    mode: Mode
    concurrency: int
    round: int
    leg: int
    prompts: int

    @property
    def name(self) -> str:
        return (
            f"{self.case.name}-{self.mode.name}-c{self.concurrency}"
            f"-r{self.round}-l{self.leg}"
        )

    @property
    def seed(self) -> int:
        """The same prompts for every mode's leg of a round."""
        return self.round + 1 + 1000 * self.leg

    @property
    def warm_up_seed(self) -> int:
        return WARM_UP_SEEDS + self.seed


def warm_up_file(result: Path) -> Path:
    """Where a leg's warm-up leaves vLLM's result, beside the leg's."""
    return result.with_suffix(".warm-up.json")


def engine_file(result: Path) -> Path:
    """Where a leg's steps and what its requests recorded in the engine
    (`wire.REQUEST_LISTS`) are left, beside vLLM's result, with the clock
    that pairs them with the client's times (``wall_clock_offset``)."""
    return result.with_suffix(".engine.json")


class Measurer:
    """The cells of a run, filled leg by leg."""

    def __init__(
        self,
        output: Path,
        workload: Workload,
        say: Callable[[str], None],
        place: Callable[[Server], Placement | None],
    ) -> None:
        self.output = output
        self.workload = workload
        self.say = say
        self.place = place
        self.cells: dict[Key, Cell] = {}
        self.quiet_at = 0.0  # when the last leg's server stops spinning

    def round(self, server: Server, case: Case, round_: int) -> None:
        """A round of `case` at each of its concurrencies: its legs, the
        modes in turn leg by leg, then each mode's round recorded."""
        for concurrency in case.concurrencies:
            taken: dict[str, list[dict]] = {mode.name: [] for mode in case.modes}
            sizes = case.leg_prompts(concurrency)
            for leg, size in enumerate(sizes):
                for mode in in_turn(case.modes, round_, leg, len(sizes)):
                    key = Key(case.name, concurrency, mode.name)
                    cell = self.cells.setdefault(key, Cell())
                    if cell.error is not None:
                        continue
                    if mode.setting is not None:
                        server.switch(mode.setting)  # raises where one did not
                    unit = Leg(case, mode, concurrency, round_, leg, size)
                    figures = self.take(server, unit, cell)
                    if figures is not None:
                        taken[mode.name].append(figures | {"leg": leg})
            for mode in case.modes:
                cell = self.cells[Key(case.name, concurrency, mode.name)]
                if cell.error is None and taken[mode.name]:
                    self.record(
                        cell,
                        f"{case.name}: {mode.name} C={concurrency}",
                        round_,
                        taken[mode.name],
                    )

    def take(self, server: Server, leg: Leg, cell: Cell) -> dict | None:
        """One leg, taken again while its figures are not the server's:
        vLLM's result with the probe's counters over it; None where the cell
        now says why not."""
        result = self.output / "results" / f"{leg.name}.json"
        result.parent.mkdir(parents=True, exist_ok=True)
        for attempt in range(RERUNS + 1):
            try:
                figures, counts = self.bench(server, leg, result)
            except (RuntimeError, OSError) as error:
                # vllm bench serve failed, or the server is gone: the log says why.
                log = server.log.read_text(errors="replace")
                cell.error = f"{error}; the server's log: {logged_exception(log)}"
                self.say(f"{leg.name}: {cell.error}")
                return None
            why = rerun_reason(figures)
            if why is None or attempt == RERUNS or not server.alive():
                break
            self.say(f"{leg.name}: {why}; taken again")
            for taken in (result, result.with_suffix(".log")):
                taken.rename(
                    taken.with_name(f"{taken.stem}.rejected{attempt}{taken.suffix}")
                )
        if failure := failed_requests(figures):
            logged = logged_exception(server.log.read_text(errors="replace"))
            cell.error = failure + (f"; the server logged: {logged}" if logged else "")
            self.say(f"{leg.name}: {cell.error}")
            return None
        return (
            figures
            | counts
            | {
                "reruns": attempt,
                "read_in_bursts": read_in_bursts(figures),
            }
        )

    def bench(self, server: Server, leg: Leg, result: Path) -> tuple[dict, dict]:
        """A leg's vLLM result, and the probe's counters over it: what the
        server needs first (`Server.prepare`, for the warm-up's prompts and
        the leg's), the warm-up (`client.warm_up`), then the leg, checked."""

        def run(url: str, saved: Path) -> dict:
            return bench(
                url, self.workload, leg.concurrency, leg.prompts, leg.seed, saved
            )

        def warmed(url: str, saved: Path) -> dict:
            warm_up(url, self.workload, leg.warm_up_seed, warm_up_file(saved))
            return run(url, saved)

        placement = self.place(server)
        time.sleep(max(0.0, self.quiet_at - time.monotonic()))
        if server.prepare(warmed, result):  # its server then spins a while
            self.quiet_at = time.monotonic() + IDLE_SPIN_SECONDS
        time.sleep(max(0.0, self.quiet_at - time.monotonic()))
        try:
            with measuring(placement):
                warm_up(
                    server.client_url, self.workload, leg.warm_up_seed,
                    warm_up_file(result),
                )  # fmt: skip
                before = server.counters()
                server.leg_begins()
                figures = run(server.client_url, result)
        finally:
            self.quiet_at = time.monotonic() + IDLE_SPIN_SECONDS
        server.check(leg.prompts, leg.concurrency)
        after = server.counters()
        counts = {
            key: counted(after[key], before[key], -1)
            for key in (*COUNTS, "preemptions")
        }
        lists = {key: after[key] for key in ("steps", *REQUEST_LISTS)}
        clock = {"wall_clock_offset": figures["wall_clock_offset"]}
        engine_file(result).write_text(json.dumps(lists | clock))
        return figures, counts | lists

    def record(self, cell: Cell, label: str, round_: int, legs: list[dict]) -> None:
        """A round's figures of a cell, over its legs; said as a progress line."""
        figures = combined(legs)
        for result in legs:
            cell.legs.append(slim(result) | {"round": round_})
        for key in (*COUNTS, "preemptions", "reruns", "read_in_bursts"):
            figures[key] = functools.reduce(counted, (leg[key] for leg in legs))
        figures.update(round=round_, legs=len(legs))
        cell.runs.append(figures)
        self.say(
            f"{label} round {round_ + 1}: {figures['completed']}/"
            f"{figures['num_prompts']} requests in {len(legs)} legs, TPOT p50 "
            f"{figures['median_tpot_ms']:.1f} ms, ITL p99 "
            f"{figures['p99_itl_ms']:.1f} ms, {figures['preemptions']:.0f} "
            f"preempted, {figures['reprefilled_tokens']} tokens recomputed"
        )
