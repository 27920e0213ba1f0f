"""The benchmark runs, here on the CPU, so that its tables cannot rot.

``python -m tools.bench`` is what the README's and
docs/benchmark.md's measurements come from; nothing else calls it. Its
times are not checked (a benchmark, not a timed test): its tables are, with
what they say of memory, which does not vary between runs.
"""

from __future__ import annotations

from tests import children
from tests.helpers import run_fresh

REQUESTS = ("1", "16")


def tables(stdout: str) -> dict[str, list[list[str]]]:
    """Each table's rows (cells, stripped), by its first column's heading."""
    found: dict[str, list[list[str]]] = {}
    rows: list[list[str]] = []
    for line in stdout.splitlines():
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0].startswith("---"):
            continue
        if cells[0] in ("case", "requests"):
            rows = found.setdefault(" ".join(cells[:2]), [])
        else:
            rows.append(cells)
    return found


def number(cell: str) -> float:
    """A time, size or ratio cell ("1.25", "0.84x", "1,024") as a number."""
    return float(cell.removesuffix("x").replace(",", ""))


def test_the_benchmark_prints_every_table_whole():
    arguments = ["--requests", *REQUESTS, "--repeats", "1", "--min-seconds", "0"]
    report = run_fresh(children.bench_tables, arguments)
    found = tables(report["stdout"])
    headings = ["case filled MiB", "requests layer fills", "requests written MiB"]
    assert list(found) == headings
    calls, step, allocated = found.values()

    assert [row[0] for row in calls] == report["cases"]
    for row in calls:
        assert all(number(cell) >= 0 for cell in row[1:]), row
    by_case = {row[0]: row for row in calls}
    # Memory: a fill allocates nothing, a random one neither (its samples are
    # drawn at the registration's first fill and kept), where upstream's
    # temporary is the region's size.
    for name, row in by_case.items():
        filled, upstream_peak, overlay_peak = map(number, (row[1], row[7], row[8]))
        if name.startswith("attention"):
            assert upstream_peak == filled, row
        assert overlay_peak == 0, row

    for rows in (step, allocated):
        assert [row[0] for row in rows] == list(REQUESTS)
    for row in step:
        # Sizes and times; then ratios, of which one under 0.005 (a slow spell
        # on the memset, timed once here) prints as 0.00x; the last, (step -
        # limit) per request, may be < 0.
        assert all(number(cell) > 0 for cell in row[1:7]), row
        assert all(number(cell) >= 0 for cell in row[7:-1]), row
        number(row[-1])
    for row in allocated:
        # What the step writes; then times and ratios, of which a time under
        # half a microsecond prints as 0.000: the constant step and the
        # random one, each against the memset and upstream.
        assert len(row) == 11, row
        assert number(row[1]) > 0, row
        assert all(number(cell) >= 0 for cell in row[2:]), row
    # The bytes written are the layers' views: the Mamba pages' state bytes,
    # not the padding up to the attention page (vLLM 0.29+'s allocator).
    assert [number(row[1]) for row in allocated] == [
        round(requests * report["written_bytes_per_request"] / 2**20, 1)
        for requests in map(int, REQUESTS)
    ]
