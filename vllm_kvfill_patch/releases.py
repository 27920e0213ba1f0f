"""What the patch does in each vLLM release range: the support policy, and
which series of ``patches/`` applies to each range.

Plain data and the standard library only. At run time the connector's
structure and probes of upstream's own methods decide (``gating``); the
policy only explains an inert verdict on a range where the patch applies.
How each release is tested, and docs/releases.md's tables generated from
this policy, are the project's, in a checkout: ``tools/matrix.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

APPLIED = "applied"
INERT = "inert"

Release = tuple[int, int, int]


DEFECTS = {
    "crashes": "_fill_blocks crashes on list/tuple (Mamba) caches",
    "whole_states": "_fill_blocks fills list/tuple state tensors whole",
    "kernel_row": "a kernel-split attention cache gets kernel row b, not block b",
    "temporaries": "each request's fill builds a temporary the size of its region",
    "zero_token_fill": "a request admitted with nothing to fill (a one-token prompt) "
    "is offered its generated tokens as external KV after a preemption (#57419)",
    "hit_blocks": "after a prefix-cache hit the cached blocks are filled, not the "
    "request's own",
}
"""What the gating's probes of upstream's methods can find wrong, in the
words of the status reason (``gating``)."""


@dataclass(frozen=True)
class ReleaseRange:
    first: Release
    """First release of the range."""
    end: Release | None
    """First release after the range; None for open-ended."""
    decision: str
    defects: tuple[str, ...]
    """The ``DEFECTS`` upstream's connector has in this range, in the status
    reason's order: on a release of the range the probes find exactly these
    (the tests check it on every release they run)."""
    also: str = ""
    """What else the range's connector does that no probe looks at."""

    def covers(self, release: Release) -> bool:
        return self.first <= release and (self.end is None or release < self.end)

    @property
    def why(self) -> str:
        """The defects in the status reason's words, then what else."""
        said = [DEFECTS[defect] for defect in self.defects]
        return "; ".join([*said, self.also] if self.also else said)


_GROUP_0 = "every layer is mapped to group 0"
_IN_EVERY_RELEASE = ("kernel_row", "temporaries", "zero_token_fill")
_KEPT_FROM_0_31 = (
    "a device sync per request x layer. Kept from upstream: per-layer fp8, "
    "zero-filled circular buffers, startup_fill, get_loaded_kv_cache_group_ids"
)

SUPPORT_POLICY = (
    ReleaseRange(
        (0, 0, 0), (0, 11, 1), INERT, (), "no DecodeBenchConnector in this release"
    ),
    ReleaseRange(
        (0, 11, 1),
        (0, 24, 0),
        APPLIED,
        ("crashes", *_IN_EVERY_RELEASE, "hit_blocks"),
        f"{_GROUP_0}; FlashAttention's (2, num_blocks, ...) cache is indexed on dim 0",
    ),
    ReleaseRange(
        (0, 24, 0),
        (0, 30, 0),
        APPLIED,
        ("whole_states", *_IN_EVERY_RELEASE, "hit_blocks"),
        f"the whole-state fill (#45080) overwrites other requests' states; {_GROUP_0}",
    ),
    ReleaseRange(
        (0, 30, 0),
        (0, 31, 0),
        APPLIED,
        ("whole_states", *_IN_EVERY_RELEASE),
        "a device sync per request x layer; fp8 (uint8) caches get the value "
        "cast to an integer",
    ),
    ReleaseRange(
        (0, 31, 0),
        (0, 34, 0),
        APPLIED,
        ("whole_states", *_IN_EVERY_RELEASE),
        _KEPT_FROM_0_31,
    ),
    ReleaseRange(
        (0, 34, 0),
        None,
        APPLIED,
        ("whole_states", *_IN_EVERY_RELEASE),
        f"{_KEPT_FROM_0_31}, no blocks recorded for groups outside KV transfer "
        "(HiSparse's hot and resident tiers)",
    ),
)
"""What the patch does, by release range (docs/releases.md's first table).
At run time the connector's structure decides; this only explains an inert
verdict on an applied range (``gating.judge``)."""


def parse_release(version: str) -> Release | None:
    """`(major, minor, patch)` of a vLLM version string, or None."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        return None
    major, minor, patch = (int(part) for part in match.groups())
    return major, minor, patch


def policy_for(version: str) -> ReleaseRange | None:
    release = parse_release(version)
    if release is None:
        return None
    return next(r for r in SUPPORT_POLICY if r.covers(release))


@dataclass(frozen=True)
class SeriesRange:
    """The releases one series of ``patches/`` applies to with ``git am``, at
    their tag; or a range none applies to, and which series to take there."""

    first: Release
    end: Release
    """First release after the range."""
    series: str | None
    """The release ``patches/v<series>/`` targets; None where none applies."""
    instead: str = ""
    """Where none applies: which series comes closest, and why."""

    def covers(self, release: Release) -> bool:
        return self.first <= release < self.end

    @property
    def name(self) -> str:
        """The range as the README's Upstreaming section writes it: "0.11.1 –
        0.23.x", "0.31 – 0.33.x", "0.34.x"."""
        major, minor, patch = self.first
        last = f"{self.end[0]}.{self.end[1] - 1}.x"
        if (major, minor + 1) == self.end[:2] and not patch:
            return last
        return f"{major}.{minor}{f'.{patch}' if patch else ''} – {last}"


PATCH_SERIES = (
    SeriesRange((0, 11, 1), (0, 24, 0), "0.23.0"),
    SeriesRange(
        (0, 24, 0),
        (0, 30, 0),
        None,
        "patches/v0.23.0/ comes closest: 0.24 - 0.29 have the defects it fixes, "
        "the blocks after a prefix-cache hit among them, but their _fill_blocks "
        "fills list states whole (#45080) where 0.23's crashed, and the series' "
        "first and third commits edit that fill: a few of their hunks are to be "
        "redone by hand",
    ),
    SeriesRange(
        (0, 30, 0),
        (0, 31, 0),
        None,
        "patches/v0.33.0/ comes closest: 0.30 has the defects it fixes, and not "
        "the prefix-cache one patches/v0.23.0/ fixes, but 0.31 rewrote the worker "
        "side its commits edit (per-layer fp8, startup fill): most of their hunks "
        "are to be redone by hand",
    ),
    SeriesRange((0, 31, 0), (0, 34, 0), "0.33.0"),
    SeriesRange((0, 34, 0), (0, 35, 0), "0.34.0"),
)
"""Which series of ``patches/`` applies to which releases: what ``python -m
vllm_kvfill_patch --patch`` prints, and the ranges the README's Upstreaming
section gives (``tests/test_policy.py`` checks that they agree). A series
is for every release of its range: the ``upstream`` sessions run ``git am``
at the tag of each that has a source distribution in ``tools/matrix.py``."""


def series_range_for(version: str) -> SeriesRange | None:
    """The ``PATCH_SERIES`` range of `version`; None outside them all."""
    release = parse_release(version)
    if release is None:
        return None
    return next((r for r in PATCH_SERIES if r.covers(release)), None)
