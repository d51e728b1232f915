"""Before/after from separate runs: `loopserve bench compare --a A1 A2 --b B1 B2`.

`bench offline --ab` alternates variants of one source tree inside one process; comparing two
source trees (a baseline commit against the working tree) takes separate processes, run A B B A in
one call (scripts/gpu_ab.sh). This command reads their JSON lines and prints, per configuration,
each side's runs, the ratio of the medians, and whether the difference exceeds the spread between
runs of the same side.

Owns: matching offline records of the two sides by configuration and tabulating them. Must not:
run anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from loopserve.bench.sweep_spec import EXIT_ALIASES

# The configuration fields that identify a comparable record.
KEY_FIELDS = ("workload", "concurrency", "exits", "scheduling", "graphs", "kv_layout")
FIGURES = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a", nargs="+", type=Path, required=True, help="JSONL files of side A")
    parser.add_argument("--b", nargs="+", type=Path, required=True, help="JSONL files of side B")
    parser.add_argument("--labels", default="A,B", help="names of the two sides, e.g. before,after")
    parser.add_argument("--output", type=Path, help="also write the markdown table here")


def read_runs(paths: list[Path]) -> dict[tuple[Any, ...], list[dict[str, float]]]:
    """Configuration key -> the figures of each run that measured it."""
    runs: dict[tuple[Any, ...], list[dict[str, float]]] = defaultdict(list)
    for path in paths:
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record.get("record") != "offline" or "figures" not in record:
                continue
            config = record["config"]
            # Records written before the trace exits were renamed say "d2.6".
            config = config | {"exits": EXIT_ALIASES.get(config["exits"], config["exits"])}
            key = tuple(config[name] for name in KEY_FIELDS)
            runs[key].append(record["figures"])
    return runs


def compare_table(
    a: dict[tuple[Any, ...], list[dict[str, float]]],
    b: dict[tuple[Any, ...], list[dict[str, float]]],
    labels: tuple[str, str],
) -> str:
    header = [*KEY_FIELDS]
    for figure in FIGURES:
        header += [f"{figure} {labels[0]}", f"{figure} {labels[1]}", f"{labels[1]}/{labels[0]}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key in sorted(set(a) & set(b), key=str):
        cells = [str(value) for value in key]
        for figure in FIGURES:
            left = [run[figure] for run in a[key] if run.get(figure) is not None]
            right = [run[figure] for run in b[key] if run.get(figure) is not None]
            if not left or not right:
                cells += ["-", "-", "-"]
                continue
            ratio = statistics.median(right) / statistics.median(left)
            noise = _spread(left) + _spread(right)
            beyond = abs(statistics.median(right) - statistics.median(left)) > noise
            verdict = "" if beyond else " (noise)"
            cells += [_runs(left), _runs(right), f"{ratio:.3f}×{verdict}"]
        lines.append("| " + " | ".join(cells) + " |")
    missing = sorted(set(a) ^ set(b), key=str)
    if missing:
        lines.append(f"\nmeasured on one side only: {missing}")
    return "\n".join(lines) + "\n"


def _spread(values: list[float]) -> float:
    return max(values) - min(values)


def _runs(values: list[float]) -> str:
    return " / ".join(f"{value:.2f}" for value in values)


def run(args: argparse.Namespace) -> int:
    labels = tuple(args.labels.split(","))
    if len(labels) != 2:
        raise ValueError(f"--labels takes two names, got {args.labels!r}")
    table = compare_table(read_runs(args.a), read_runs(args.b), (labels[0], labels[1]))
    print(table)
    if args.output is not None:
        args.output.write_text(table)
    return 0
