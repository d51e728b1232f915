"""Tables (and a plot) of `loopserve bench serve` runs at several request rates:
`python -m benchmarks.rate_table RUNS.jsonl [--plot FILE]` (scripts/gpu_serve_rates.sh writes the
lines).

Owns: one table per run label (an exit setting and a workload), one row per request rate in
ascending order: throughput, TTFT / TPOT / ITL p50 and p99, and the goodput (requests/s that met
every target of the run's `--goodput`, with its share of the request rate); the plot draws TTFT
p99, TPOT p99 and goodput against the rate, a line per label. Must not: run anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

COLUMNS = (
    "rate req/s", "done", "req/s", "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
    "ITL p50 / p99 ms", "goodput req/s",
)  # fmt: skip


def _rate(run: dict[str, Any]) -> float:
    """The offered request rate; bench serve records an unbounded one as the string "inf"."""
    return float(run["config"]["request_rate"])


def by_label(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Runs grouped by label, each group by ascending request rate."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[run["config"].get("label") or "-"].append(run)
    return {label: sorted(group, key=_rate) for label, group in groups.items()}


def _pair(run: dict[str, Any], metric: str) -> str:
    low, high = run.get(f"p50_{metric}_ms"), run.get(f"p99_{metric}_ms")
    return "-" if low is None or high is None else f"{low:.1f} / {high:.1f}"


def _goodput(run: dict[str, Any]) -> str:
    goodput, rate = run.get("request_goodput"), run["request_throughput"]
    if goodput is None:
        return "-"
    return f"{goodput:.2f} ({goodput / rate:.0%})" if rate else f"{goodput:.2f}"


def render(runs: list[dict[str, Any]]) -> str:
    lines = []
    for label, group in by_label(runs).items():
        targets = group[0].get("goodput_targets_ms") or {}
        target_text = ", ".join(f"{metric} ≤ {ms:g} ms" for metric, ms in targets.items())
        lines += [f"## {label}" + (f" (goodput: {target_text})" if target_text else ""), ""]
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        for run in group:
            cells = [
                f"{_rate(run):g}",
                f"{run['completed']}/{run['completed'] + run['failed']}",
                f"{run['request_throughput']:.2f}",
                f"{run['output_throughput']:.0f}",
                _pair(run, "ttft"),
                _pair(run, "tpot"),
                _pair(run, "itl"),
                _goodput(run),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("p99_ttft_ms", "TTFT p99 (ms)"), ("p99_tpot_ms", "TPOT p99 (ms)"))
    for label, group in by_label(runs).items():
        rates = [_rate(run) for run in group]
        for axis, (key, title) in zip(axes, panels, strict=False):
            axis.plot(rates, [run.get(key) for run in group], marker="o", label=label)
            axis.set_title(title)
        axes[2].plot(rates, [run.get("request_goodput") for run in group], marker="o", label=label)
        axes[2].set_title("goodput (requests/s meeting the targets)")
    for axis in axes:
        axis.set_xlabel("request rate (requests/s, Poisson)")
        axis.grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("runs", type=Path, help="JSON lines of `loopserve bench serve --output`")
    parser.add_argument("--plot", type=Path, help="also draw the curves into this PNG")
    args = parser.parse_args(argv)
    runs = [json.loads(line) for line in args.runs.read_text().splitlines() if line.strip()]
    print(render(runs), end="")
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
