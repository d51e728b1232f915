"""Plots of a perplexity curve: quality against mean depth, and the exit-depth histograms.

Owns: drawing `CurvePoint`s to an image file (each exit threshold its own coloured marker, named in
the legend, so close thresholds such as 0.9 and 0.95 never write over each other), and the check
that matplotlib imports, which `--plot` runs before any evaluation. Must not: compute any figure it
draws, or be imported by anything that runs without `--plot` (matplotlib is an optional
dependency).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loopserve.eval.perplexity import CurvePoint


def require_matplotlib() -> Any:
    """`matplotlib.pyplot` (non-interactive backend); a one-line ValueError when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'loopserve[plot]'") from None
    return plt


def plot_curve(points: list[CurvePoint], path: Path, title: str) -> Path:
    """Draw `draw_curve`'s figure to `path` (.png, .svg, .pdf)."""
    plt = require_matplotlib()
    figure = draw_curve(points, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def draw_curve(points: list[CurvePoint], title: str) -> Any:
    """Left: perplexity vs mean exit depth (fixed depths joined; each exit threshold a marker of
    its own colour, named in the legend). Right: for each exit threshold, the fraction of tokens
    that exited after each loop. Returns the matplotlib figure."""
    plt = require_matplotlib()
    fixed = [point for point in points if point.exit_threshold >= 1.0]
    gated = [point for point in points if point.exit_threshold < 1.0]
    figure, (quality, histogram) = plt.subplots(1, 2, figsize=(11, 4.2))
    if fixed:
        quality.plot(
            [p.mean_depth for p in fixed], [p.perplexity for p in fixed], "o-", label="fixed depth"
        )
    colours = plt.get_cmap("viridis")
    for index, point in enumerate(sorted(gated, key=lambda p: -p.exit_threshold)):
        quality.plot(
            [point.mean_depth],
            [point.perplexity],
            "s",
            color=colours(0.85 * index / max(1, len(gated) - 1)),  # no pale yellow
            label=f"exit gate {point.exit_threshold:g}",
        )
    quality.set(xlabel="mean exit depth (loops)", ylabel="held-out perplexity", title=title)
    quality.legend(fontsize=8)
    quality.grid(alpha=0.3)
    _draw_histograms(histogram, gated or fixed[-1:])
    figure.tight_layout()
    return figure


def _draw_histograms(axes: Any, points: list[CurvePoint]) -> None:
    """Grouped bars: for each point, the fraction of tokens that exited after each loop."""
    width = 0.8 / max(1, len(points))
    for index, point in enumerate(points):
        depths = range(1, len(point.depth_histogram) + 1)
        fractions = [count / point.tokens for count in point.depth_histogram]
        offsets = [depth - 0.4 + width * (index + 0.5) for depth in depths]
        axes.bar(offsets, fractions, width=width, label=point.label)
    axes.set(xlabel="exit depth (loops)", ylabel="fraction of tokens", title="exit depths")
    axes.set_xticks(range(1, max(len(point.depth_histogram) for point in points) + 1))
    axes.legend(fontsize=8)
