"""What the tool and the probe in each of vLLM's processes share: the
environment the tool sets, the control channel's files and questions, the
counters and their histogram's buckets, a connector mode's setting, and
what a process answers.

What runs inside `vllm serve` (`probe`, `switch`, `connector`) and what
drives it from outside meet here and nowhere else: both import this module,
and it imports neither, as vLLM's own benchmarks reach a server only
through HTTP and files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypedDict

DIR_ENV = "KVFILL_FIDELITY_PROBE_DIR"
"""The directory of a server's control channel; unset, the probe does
nothing."""
DECODE_TOKENS_ENV = "KVFILL_FIDELITY_DECODE_TOKENS"
"""A forward pass of at most this many tokens is a decode step (the expert
and subnormal counts see those only)."""
SUBNORMALS_ENV = "KVFILL_FIDELITY_SUBNORMALS"
"""``1``: count subnormal floats in every module's outputs (slower)."""
NIXL_REST_ENV = "KVFILL_NIXL_PROGRESS_REST_US"
"""Microseconds NIXL's progress thread rests between its polls (`nixl_rest`);
unset, NIXL's own (none)."""
NIXL_THREADS = ".nixl"
"""``<dir>/<pid>.nixl``: the threads NIXL's agents started in that process,
one id a line."""

QUESTIONS = ".ask"
"""``<dir>/<pid>.ask``: each process's FIFO, which the tool writes its
questions to (`question_line`)."""
ANSWERS = ".json"
"""``<dir>/<pid>.json``: each process's `Answer`, replaced whole at each
question."""


@dataclass(frozen=True)
class Setting:
    """What a connector mode switches in each of vLLM's processes."""

    package: bool
    """This package applied (else reverted: upstream's connector)."""
    writes: bool
    """The worker writes the fill (else nothing: the ideal)."""
    refill: bool
    """A preempted request is filled again (a decode node with an offload
    tier) instead of recomputed."""
    link: tuple[float, float | None] | None = None
    """The link model in force with the package: (latency in ms, Gb/s per
    rank or None for no limit); None: the KV arrives as the connector
    delivers it, in the step that admits the request."""
    sharing: str = "fifo"
    """How the link's transfers share it (``transfer_sharing``)."""

    @property
    def decision(self) -> str:
        """This package's decision in the mode's processes."""
        return "applied" if self.package else "reverted"

    def encoded(self) -> str:
        """One word, for the control channel."""
        flags = ",".join(f"{key}={int(getattr(self, key))}" for key in FLAGS)
        if self.link is None:
            return flags
        latency, gbps = self.link
        gbps_word = "" if gbps is None else repr(gbps)
        return f"{flags},link={latency!r}:{gbps_word}:{self.sharing}"

    @classmethod
    def decoded(cls, word: str) -> Setting:
        fields = dict(item.split("=") for item in word.split(","))
        link, sharing = None, "fifo"
        if (link_word := fields.pop("link", None)) is not None:
            latency, gbps, sharing = link_word.split(":")
            link = (float(latency), float(gbps) if gbps else None)
        flags = {key: value == "1" for key, value in fields.items()}
        return cls(**flags, link=link, sharing=sharing)


FLAGS = ("package", "writes", "refill")
"""A setting's switches, each on or off."""


def question_line(number: int, setting: Setting | None = None) -> str:
    """A question: its number, larger than any asked before, then the
    setting the process puts in force before it answers, if any. One line
    under PIPE_BUF bytes, so that it reaches the FIFO whole."""
    return f"{number} {setting.encoded()}\n" if setting else f"{number}\n"


def read_question(line: str) -> tuple[int, str]:
    """A question's number, and its setting's word ("" for none)."""
    number, _, setting = line.partition(" ")
    return int(number), setting


class InForce(TypedDict):
    """What holds in a process with the connector, after a switch."""

    decision: str  # this package's (`Setting.decision`)
    writes: bool
    refill: list[bool | None]  # one per scheduler-side connector
    # one per scheduler-side connector: [latency ms, Gb/s or None, sharing],
    # or None
    link: list[list | None]
    connectors: list[str]  # each connector's role: SCHEDULER, WORKER


COUNTS = (
    "reprefilled_tokens",
    "expert_forwards",
    "expert_imbalance_sum",
    "subnormal_outputs",
    "checked_outputs",
    "fill_calls",
    "fill_seconds",
    "fill_histogram",
)
"""The counters of an `Answer`, cumulative in each process: a server's are
their sum over its processes, a leg's their difference across it
(`counted`)."""


class Answer(TypedDict):
    """A process's ``<pid>.json``: what held at its last answer."""

    answered: int  # the question it answers (0: saved at the process's start)
    kernels: list[str]  # the vLLM kernel libraries it mapped
    placement: dict[str, Any]  # its name (process), cores, niceness, policy
    # After a setting: what holds, {"skipped": why} in a process without the
    # connector, or {"error": why}; None before any.
    switch: InForce | dict[str, str] | None
    reprefilled_tokens: int
    expert_forwards: int
    expert_imbalance_sum: float
    subnormal_outputs: int
    checked_outputs: int
    fill_calls: int
    fill_seconds: float
    fill_histogram: list[int]
    # (seconds, fill seconds) of each forward pass since its last answer
    steps: list[tuple[float, float]]
    # seconds each request waited for its KV (in WAITING_FOR_REMOTE_KVS,
    # from the step that admitted it to the step that scheduled it), since
    # its last answer
    kv_waits: list[float]
    # seconds from each request's arrival at the server to its admission
    # (vLLM's arrival time, wall clock), since its last answer
    admissions: list[float]
    # each request's id, its arrival at the server and the engine's first
    # token for it (the scheduler took it from the worker's output), wall
    # clock, since its last answer
    first_tokens: list[tuple[str, float, float]]


REQUEST_LISTS = ("kv_waits", "admissions", "first_tokens")
"""The lists a probe records per request, handed out once each
(`Answer`): a leg keeps what its requests recorded."""


def counted(a: Any, b: Any, sign: int = 1) -> Any:
    """a + sign * b, for counters (a histogram bucket by bucket)."""
    if isinstance(a, list):
        return [x + sign * y for x, y in zip(a, b, strict=True)]
    return a + sign * b


BUCKETS_PER_OCTAVE = 70
"""So that a percentile read from the buckets is within 1% of the true one
(2 ** (1 / 70) = 1.00995): two modes' fill p99 print alike only where their
step times are within 1%, under the ±5% bar."""
FILL_BUCKETS = 24 * BUCKETS_PER_OCTAVE
"""Buckets of ``fill_histogram``: bucket k counts the fills of at most
``fill_bucket_bound(k)`` seconds (and more than bucket k - 1's), from 1 us
to 16.8 s; the last also counts any longer."""


def fill_bucket_bound(bucket: int) -> float:
    """The longest fill, in seconds, that `bucket` counts."""
    return 1e-6 * 2 ** (bucket / BUCKETS_PER_OCTAVE)


def fill_bucket(seconds: float) -> int:
    """The bucket that counts a fill of `seconds`."""
    if seconds <= 1e-6:
        return 0
    octaves = math.log2(seconds / 1e-6)
    return min(FILL_BUCKETS - 1, math.ceil(BUCKETS_PER_OCTAVE * octaves))
