"""Plots output throughput against concurrency, one line per variant, one panel per workload.

Owns: the PNG of `loopserve bench offline --plot`. Must not: import matplotlib at module import
(it is optional and slow); it is imported inside `plot_throughput`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loopserve.bench.sweep_spec import SpecResult, Variant, Workload


def plot_throughput(results: list[SpecResult], path: Path) -> Path:
    """Median output tok/s vs concurrency (log2 axis) with min–max error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({result.spec.point.workload for result in results})
    layouts = {result.spec.variant.kv_layout for result in results}
    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for axis, workload in zip(axes[0], workloads, strict=True):
        _panel(axis, workload, [r for r in results if r.spec.point.workload == workload], layouts)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _panel(axis: Any, workload: Workload, results: list[SpecResult], layouts: set[str]) -> None:
    series: dict[Variant, list[SpecResult]] = {}
    for result in results:
        series.setdefault(result.spec.variant, []).append(result)
    for variant, points in series.items():
        points.sort(key=lambda result: result.spec.point.concurrency)
        x = [result.spec.point.concurrency for result in points]
        y, below, above = [], [], []
        for result in points:
            median = float(result.medians["output_tok_s"] or 0.0)
            low, high = result.spread["output_tok_s"]
            y.append(median)
            below.append(median - float(median if low is None else low))
            above.append(float(median if high is None else high) - median)
        axis.errorbar(
            x,
            y,
            yerr=[below, above],
            marker="o",
            capsize=3,
            linestyle="-" if variant.graphs else "--",
            label=variant.label(with_layout=len(layouts) > 1),
        )
    axis.set_xscale("log", base=2)
    ticks = sorted({result.spec.point.concurrency for result in results})
    axis.set_xticks(ticks, [str(tick) for tick in ticks])
    axis.minorticks_off()
    axis.set_xlabel("concurrency (requests in flight)")
    axis.set_ylabel("output tokens / s")
    axis.set_title(f"offline {workload.name}")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
