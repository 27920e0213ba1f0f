"""What a run measures, and in what order: the cases, their rounds and legs.

A round of a case measures each of its modes once at each concurrency, in
legs of whole waves of requests; the connector modes take turns leg by leg,
switched on one server, rotated each leg, so that a slow spell of the
machine falls on every mode alike and each leg pairs with the reference's
leg seconds apart. Real prefill, which has no connector, is measured on a
server of its own, before. Why these numbers: docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from vllm_kvfill_patch.fidelity.modes import (
    MODES,
    NODE,
    PREFILL,
    REFILL_PAIR,
    Mode,
    with_link,
    with_sharing,
)

MIN_WAVES = 4
"""Waves of requests a run takes at least: one a leg, four legs."""
EMBEDDED_PREEMPTION_BLOCKS = 24
"""A KV cache of the embedded model that holds about three requests of 512 +
64 tokens: vLLM preempts from four on."""


@dataclass(frozen=True)
class Profile:
    """How long a run measures: the quick default, or `--thorough`."""

    rounds: int
    steps_per_run: int
    """Decode steps a run of the main case spans at least (its ITL p99 is
    set by its slowest 1% of steps)."""
    settle_minutes: float
    value_cycles: int


QUICK = Profile(rounds=2, steps_per_run=500, settle_minutes=0.0, value_cycles=0)
THOROUGH = Profile(rounds=6, steps_per_run=1000, settle_minutes=15.0, value_cycles=200)


@dataclass(frozen=True)
class Case:
    """Modes measured on one server, at some concurrencies."""

    name: str
    modes: tuple[Mode, ...]
    concurrencies: tuple[int, ...]
    serve_args: tuple[str, ...]
    waves: int
    """Waves of requests a round of a mode takes at each concurrency."""
    legs: int

    def leg_prompts(self, concurrency: int) -> list[int]:
        """The prompts of each leg of a round: whole waves, as even as they
        divide."""
        count = max(1, min(self.legs, self.waves))
        share, more = divmod(self.waves, count)
        return [(share + (leg < more)) * concurrency for leg in range(count)]


@dataclass(frozen=True)
class Plan:
    """Every case of a run, and how many rounds each takes."""

    prefill: Case | None
    node: Case | None
    """The real decode node: a NIXL pair of its own, measured as the
    connector modes are."""
    main: Case
    preemption: Case | None
    rounds: int
    prefill_rounds: int
    settle_minutes: float
    value_cycles: int

    def with_link(self, link: tuple[float, float | None]) -> Plan:
        """The plan, its linked modes crossing `link` (latency ms, Gb/s)."""
        return replace(
            self,
            main=replace(self.main, modes=with_link(self.main.modes, link)),
            preemption=self.preemption
            and replace(self.preemption, modes=with_link(self.preemption.modes, link)),
        )

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        profile = THOROUGH if args.thorough else QUICK
        modes = [MODES[name] for name in args.modes]
        if args.refill:
            modes += REFILL_PAIR
        switched = with_sharing(
            tuple(mode for mode in modes if mode.setting is not None), args.link_sharing
        )
        main = Case(
            "main", switched, tuple(sorted(args.concurrency)), (),
            main_waves(args, profile), args.legs,
        )  # fmt: skip
        prefill, node = (
            Case("main", (mode,), main.concurrencies, (), main.waves, main.legs)
            if mode in modes
            else None
            for mode in (PREFILL, NODE)
        )
        unlinked = tuple(mode for mode in switched if not mode.linked)
        plan = cls(
            prefill=prefill,
            node=node,
            main=main,
            preemption=preemption_case(args, unlinked),
            rounds=int(pick(args.rounds, profile.rounds)),
            prefill_rounds=args.prefill_rounds,
            settle_minutes=pick(args.settle_minutes, profile.settle_minutes),
            value_cycles=int(pick(args.value_cycles, profile.value_cycles)),
        )
        return plan.with_link(args.link) if args.link else plan


def pick(given: int | float | None, default: int | float) -> int | float:
    return default if given is None else given


def main_waves(args: argparse.Namespace, profile: Profile) -> int:
    """Waves a round of the main case takes: `--prompts-per-concurrency`, or
    enough for the profile's decode steps, at least `MIN_WAVES`."""
    if args.prompts_per_concurrency is not None:
        return args.prompts_per_concurrency
    steps = pick(args.steps_per_run, profile.steps_per_run)
    return max(MIN_WAVES, math.ceil(steps / max(1, args.output_len - 1)))


def preemption_case(args: argparse.Namespace, modes: tuple[Mode, ...]) -> Case | None:
    """The connector modes again on a KV cache small enough that vLLM
    preempts, where there are blocks to give it (the embedded model's by
    default; a user's model only when asked)."""
    blocks = args.preemption_blocks
    if blocks is None:
        blocks = EMBEDDED_PREEMPTION_BLOCKS if args.model is None else 0
    if not blocks or not modes:
        return None
    return Case(
        "preemption", modes, (args.preemption_concurrency,),
        ("--num-gpu-blocks-override", str(blocks)), MIN_WAVES, args.legs,
    )  # fmt: skip


def in_turn(modes: tuple[Mode, ...], round_: int, leg: int, legs: int) -> list[Mode]:
    """The modes in the order they take a leg: rotated each leg, so that no
    mode always goes first."""
    shift = (round_ * legs + leg) % len(modes)
    return [*modes[shift:], *modes[:shift]]
