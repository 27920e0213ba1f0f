"""The run's picture: each mode's distance from its reference, with its
interval, per concurrency (one panel a figure of the bar, the bar shaded),
and the fill's time per step, each connector mode that writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_kvfill_patch.fidelity.report import Row
from vllm_kvfill_patch.fidelity.stats import BAR


def draw(found: list[Row], path: Path, title: str) -> str:
    """The main case's rows as a PNG at `path`; what was drawn, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no picture: matplotlib is not installed (pip install matplotlib)"
    main = [row for row in found if row.key.case == "main"]
    figure, axes = plt.subplots(1, len(BAR) + 1, figsize=(14, 4.2))
    for axis, bar in zip(axes, BAR, strict=False):
        distances(axis, main, bar.key, bar.tolerance)
        axis.set_title(f"{bar.name} against the ideal (95% interval)", fontsize=9)
    fill_times(axes[-1], main)
    concurrencies = sorted({row.key.concurrency for row in main})
    for axis in axes:
        axis.set_xscale("log", base=2)
        axis.set_xticks(concurrencies, [str(c) for c in concurrencies])
        axis.set_xlabel("concurrency")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return str(path)


def distances(axis: Any, main: list[Row], key: str, tolerance: float) -> None:
    """Each connector mode's estimate, its interval as an error bar, side by
    side at each concurrency; the bar's band shaded. Real prefill, which
    differs by a prefill's cost, is in the table only."""
    modes = sorted({row.key.mode for row in main if row.ratios and row.mode.setting})
    for offset, mode in enumerate(modes):
        points = [
            (row.key.concurrency, ratio)
            for row in main
            if row.key.mode == mode and (ratio := row.ratios.get(key)) is not None
        ]
        if not points:
            continue
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
    axis.axhspan(-100 * tolerance, 100 * tolerance, color="green", alpha=0.12)
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_ylabel("% against the ideal")


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
