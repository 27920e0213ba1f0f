"""How the tools time a fill: every call of a row warmed up, then timed in
turn with the others, round after round, until each has run long enough;
each call's median, and its ratio to the row's limit.

PyTorch alone (``tools/gpu_check.py`` runs it on a bare GPU machine).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

MIN_MEASURED_SECONDS = 0.05
"""A call is timed at least `Timing.repeats` times and for at least this long: a
call of microseconds is timed thousands of times, so that its median is not
one scheduler hiccup's."""

ROUND_SECONDS = 0.01
"""About how long each call runs in a round of `measure_in_turn`."""


@dataclass(frozen=True)
class Timing:
    """How long each call is timed: at least `repeats` runs and at least
    `min_seconds` in all."""

    repeats: int
    min_seconds: float = MIN_MEASURED_SECONDS

    def with_repeats(self, repeats: int) -> Timing:
        return Timing(repeats, self.min_seconds)


@dataclass
class Measured:
    """A call's median time (None where it raised: `error`) and, where asked,
    the peak memory it allocated."""

    seconds: float | None
    peak_bytes: int | None = None
    error: str | None = None


def measure_in_turn(
    calls: Mapping[str, Callable[[], object]],
    device: torch.device,
    timing: Timing,
    wait: bool = True,
) -> dict[str, Measured]:
    """Each call's median time, the calls timed in turn, round after round,
    until each has run as long as `timing` says; with `wait`, until the
    device has done it, else until it returns (what the host pays: on a
    GPU, the launches).

    A table's ratio compares calls measured in the same rounds: a slow spell
    of a shared machine (a second or two) falls on all of them alike, where
    timed one after the other it could fall on one of them only. In a round
    each call runs for about `ROUND_SECONDS` (once, if one run takes longer),
    so that a call of microseconds does not make one of milliseconds run
    thousands of times; worked out again from its median after each round, so
    that a slow warm-up does not leave a fast call running once a round (each
    run then pays what a round's other calls left cold: a sleeping thread)."""
    results: dict[str, Measured] = {}
    runs_per_round: dict[str, int] = {}
    for name, call in calls.items():
        start = time.perf_counter()
        try:
            call()  # warm-up, and the first error
            synchronize(device)
        except Exception as exc:  # noqa: BLE001 - upstream may crash; report it
            results[name] = Measured(None, None, f"{type(exc).__name__}: {exc}")
        else:
            warm_up = time.perf_counter() - start
            runs_per_round[name] = max(1, int(ROUND_SECONDS / max(warm_up, 1e-9)))
    times: dict[str, list[float]] = {name: [] for name in runs_per_round}
    while any(
        len(taken) < timing.repeats or sum(taken) < timing.min_seconds
        for taken in times.values()
    ):
        for name, runs in list(runs_per_round.items()):
            for _ in range(runs):
                synchronize(device)
                start = time.perf_counter()
                calls[name]()
                if wait:
                    synchronize(device)
                times[name].append(time.perf_counter() - start)
            this_round = statistics.median(times[name][-runs:])
            runs_per_round[name] = max(1, int(ROUND_SECONDS / max(this_round, 1e-9)))
    synchronize(device)
    for name, taken in times.items():
        results[name] = Measured(statistics.median(taken))
    return {name: results[name] for name in calls}


def measure(
    call: Callable[[], object],
    device: torch.device,
    timing: Timing,
    peak: bool = True,
) -> Measured:
    """`call`'s median time and (with `peak`) its peak memory."""
    measured = measure_in_turn({"call": call}, device, timing)["call"]
    if peak and measured.seconds is not None:
        measured.peak_bytes = peak_allocated(call, device)
    return measured


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_allocated(call: Callable[[], object], device: torch.device) -> int:
    """The most memory `call` holds at once beyond what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    # Allocations are charged to the op that made them, frees to "[memory]".
    current = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += event.self_cpu_memory_usage
        peak = max(peak, current)
    return peak


def seconds(measured: Measured) -> float:
    """The time; a measurement that failed stops the table with its error."""
    if measured.seconds is None:
        raise RuntimeError(f"a measurement failed: {measured.error}")
    return measured.seconds


def against(measured: float, limit: float) -> str:
    """`measured` as a multiple of `limit` (a memset of the same bytes)."""
    return f"{measured / limit:.2f}x"
