"""The run's picture: each emulated mode against the real decode node, with
its interval, per concurrency (one panel a figure: decode TTFT, TPOT p50,
ITL p99), where the node ran; then each mode's distance from its reference
(one panel a figure of the bar, the bar shaded) and the fill's time per
step, each connector mode that writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_kvfill_patch.fidelity.node_report import AGAINST_NODE, node_rows, ratios
from vllm_kvfill_patch.fidelity.report import Row
from vllm_kvfill_patch.fidelity.stats import BAR, Ratio

Points = dict[str, list[tuple[int, Ratio]]]
"""Per mode, its ratio at each concurrency."""


def draw(found: list[Row], path: Path, title: str) -> str:
    """The main case's rows as a PNG at `path`; what was drawn, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no picture: matplotlib is not installed (pip install matplotlib)"
    figure = figure_of(found, title)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def figure_of(found: list[Row], title: str) -> Any:
    """The picture's figure: a row of panels against the real node where it
    ran, then a row against the ideal and the fill's time per step."""
    import matplotlib.pyplot as plt

    main = [row for row in found if row.key.case == "main"]
    against_node = against_the_node(main)
    rows = 2 if against_node else 1
    figure, grid = plt.subplots(
        rows, len(BAR) + 1, figsize=(14, 4.2 * rows), squeeze=False
    )
    if against_node:
        for axis, (key, name) in zip(grid[0], AGAINST_NODE, strict=True):
            distances(axis, against_node.get(key, {}), None, "% against the real node")
            axis.set_title(f"{name} against the real decode node", fontsize=9)
    bottom = grid[-1]
    for axis, bar in zip(bottom, BAR, strict=False):
        points = against_ideal(main, bar.key)
        distances(axis, points, bar.tolerance, "% against the ideal")
        axis.set_title(f"{bar.name} against the ideal (95% interval)", fontsize=9)
    fill_times(bottom[-1], main)
    concurrencies = sorted({row.key.concurrency for row in main})
    for axis in grid.flat:
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrency")
        axis.grid(True, alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # a panel with nothing drawn has none
            axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    return figure


def against_ideal(main: list[Row], key: str) -> Points:
    """Each connector mode's figure against its reference. Real prefill,
    which differs by a prefill's cost, is in the table only."""
    points: Points = {}
    for row in main:
        if row.mode.setting and (ratio := row.ratios.get(key)) is not None:
            points.setdefault(row.key.mode, []).append((row.key.concurrency, ratio))
    return points


def against_the_node(main: list[Row]) -> dict[str, Points]:
    """Per figure held to the node, each emulated mode against it ({} where
    the node did not run)."""
    nodes = node_rows(main)
    found: dict[str, Points] = {}
    for row in main:
        node = nodes.get((row.key.case, row.key.concurrency))
        if node is None or row is node or not row.mode.setting:
            continue
        for key, ratio in ratios(row, node).items():
            if ratio is not None:
                mode_points = found.setdefault(key, {})
                mode_points.setdefault(row.key.mode, []).append(
                    (row.key.concurrency, ratio)
                )
    return found


def distances(
    axis: Any, points_by_mode: Points, tolerance: float | None, label: str
) -> None:
    """Each mode's estimate, its interval as an error bar, side by side at
    each concurrency; the bar's band shaded where there is one."""
    modes = sorted(points_by_mode)
    for offset, mode in enumerate(modes):
        points = points_by_mode[mode]
        shift = 1.08 ** (offset - (len(modes) - 1) / 2)
        xs = [c * shift for c, _ in points]
        ys = [100 * r.estimate for _, r in points]
        low = [
            100 * (r.estimate - r.low) if r.low is not None else 0 for _, r in points
        ]
        high = [
            100 * (r.high - r.estimate) if r.high is not None else 0 for _, r in points
        ]
        axis.errorbar(xs, ys, yerr=[low, high], fmt="o", capsize=3, label=mode)
    if tolerance is not None:
        axis.axhspan(-100 * tolerance, 100 * tolerance, color="green", alpha=0.12)
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_ylabel(label)


def fill_times(axis: Any, main: list[Row]) -> None:
    """The fill's time per forward pass, p99 and mean, per mode that writes."""
    for mode in sorted({row.key.mode for row in main}):
        mode_rows = [r for r in main if r.key.mode == mode and r.fill_p99_ms]
        setting = mode_rows[0].mode.setting if mode_rows else None
        if setting is None or not setting.writes:
            continue
        xs = [row.key.concurrency for row in mode_rows]
        p99 = [row.fill_p99_ms for row in mode_rows]
        (line,) = axis.plot(xs, p99, marker="o", label=f"{mode} p99")
        mean = [row.fill_mean_ms for row in mode_rows]
        axis.plot(
            xs,
            mean,
            marker=".",
            linestyle="--",
            color=line.get_color(),
            label=f"{mode} mean",
        )
    axis.set_yscale("log")
    axis.set_ylabel("fill time per step (ms)")
    axis.set_title("the fill's time per step, inside vLLM's worker", fontsize=9)
