"""Markdown tables of `loopserve bench serve` runs (`python -m benchmarks.serve_table FILE`).

Owns: one row per run (its `--label`, workload and figures) in file order, and, where the labels
name the sides of an A/B comparison (`A1`, `A2`, ... against `B1`, `B2`, ...), the B/A ratio of
output tok/s per workload with B's TPOT p99 beside A's at half the concurrency (the scaling
question: do N replicas serve N times the load at no worse latency?). Must not: run anything.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

RUN_COLUMNS = (
    "label", "C", "prompts", "shared prefix", "extra body", "output tok/s", "TTFT p50 / p99 ms",
    "TPOT p50 / p99 ms", "prefix hit rate", "failed",
)  # fmt: skip
SIDE = re.compile(r"^([AB])\d+$")


def render(records: list[dict[str, Any]]) -> str:
    lines = _table(RUN_COLUMNS, [_run_row(record) for record in records])
    ratios = _ratio_rows(records)
    if ratios:
        columns = (
            "workload", "C", "A tok/s", "B tok/s", "B / A", "B TPOT p99 ms",
            "A TPOT p99 ms at C/2",
        )  # fmt: skip
        lines += ["", *_table(columns, ratios)]
    return "\n".join(lines) + "\n"


def _run_row(record: dict[str, Any]) -> list[str]:
    config = record["config"]
    return [
        str(config.get("label") or "-"),
        str(config["max_concurrency"]),
        str(config["num_prompts"]),
        _prefix(config),
        _extra(config),
        _number(record["output_throughput"]),
        f"{_number(record['p50_ttft_ms'])} / {_number(record['p99_ttft_ms'])}",
        f"{_number(record['p50_tpot_ms'], 2)} / {_number(record['p99_tpot_ms'], 2)}",
        _number(record.get("prefix_cache_hit_rate"), 3),
        str(record["failed"]),
    ]


def _ratio_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    throughput: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    tpot_p99: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    concurrency: dict[str, int] = {}
    for record in records:
        config = record["config"]
        side = SIDE.match(str(config.get("label") or ""))
        if side is None or record["failed"]:
            continue
        workload = (
            f"{config['input_len']}/{config['output_len']} {_prefix(config)} {_extra(config)}"
        )
        key = (workload, str(config["max_concurrency"]))
        concurrency[key[1]] = int(config["max_concurrency"])
        throughput[key][side.group(1)].append(float(record["output_throughput"]))
        if record["p99_tpot_ms"] is not None:
            tpot_p99[key][side.group(1)].append(float(record["p99_tpot_ms"]))
    rows = []
    for (workload, c), sides in throughput.items():
        if not sides["A"] or not sides["B"]:
            continue
        a, b = mean(sides["A"]), mean(sides["B"])
        half = tpot_p99.get((workload, str(concurrency[c] // 2)), {}).get("A")
        b_tpot = tpot_p99[(workload, c)]["B"]
        rows.append(
            [
                workload, c, _number(a), _number(b), f"{b / a:.2f}×",
                _number(mean(b_tpot) if b_tpot else None, 2),
                _number(mean(half) if half else None, 2),
            ]
        )  # fmt: skip
    return rows


def _prefix(config: dict[str, Any]) -> str:
    length = config.get("shared_prefix_len") or 0
    if not length:
        return "-"
    return f"{config['shared_prefix_fraction']:.0%} × {length}"


def _extra(config: dict[str, Any]) -> str:
    extra = config.get("extra_body") or {}
    return " ".join(f"{key}={json.dumps(value)}" for key, value in extra.items()) or "-"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(columns) + " |",
        "|" + " --- |" * len(columns),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.serve_table RUNS.jsonl", file=sys.stderr)
        return 2
    lines = Path(argv[0]).read_text().splitlines()
    print(render([json.loads(line) for line in lines if line.strip()]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
