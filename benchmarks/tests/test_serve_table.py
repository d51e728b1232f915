"""The scaling tables of `bench serve` runs: a row per run, and B/A per workload from the labels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.serve_table import main, render


def _record(label: str, concurrency: int, tok_s: float, tpot_p99: float, **config: Any) -> dict:
    return {
        "config": {
            "label": label, "max_concurrency": concurrency, "num_prompts": concurrency,
            "input_len": 512, "output_len": 128, "shared_prefix_len": 0,
            "shared_prefix_fraction": 0.0, "extra_body": {}, **config,
        },
        "output_throughput": tok_s, "p50_ttft_ms": 10.0, "p99_ttft_ms": 20.0,
        "p50_tpot_ms": 5.0, "p99_tpot_ms": tpot_p99, "prefix_cache_hit_rate": None, "failed": 0,
    }  # fmt: skip


def test_runs_and_the_two_sides_ratio() -> None:
    records = [
        _record("A1", 128, 900.0, 30.0),
        _record("A1", 256, 1000.0, 50.0),
        _record("B1", 256, 1900.0, 28.0),
        _record("Boff", 256, 100.0, 1.0, shared_prefix_len=384, shared_prefix_fraction=0.5),
        _record("B2", 256, 2100.0, 32.0),
        _record("A2", 256, 1000.0, 50.0, extra_body={"min_loops": 4}),
    ]
    text = render(records)
    runs, ratios = text.split("\n\n")
    assert len(runs.splitlines()) == 2 + len(records)
    assert "| Boff | 256 | 256 | 50% × 384 | - | 100.0 |" in runs
    assert "min_loops=4" in runs
    # Only 512/128 at C=256 without extra body has both sides; Boff is no side.
    (row,) = ratios.splitlines()[2:]
    assert row == "| 512/128 - - | 256 | 1,000.0 | 2,000.0 | 2.00× | 30.00 | 30.00 |"


def test_without_both_sides_there_is_only_the_run_table(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(_record("cpu", 2, 5.0, 1.0)) + "\n")
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.count("| cpu |") == 1
    assert main([]) == 2


def test_failed_runs_are_left_out_of_the_ratio() -> None:
    records = [_record("A1", 8, 10.0, 1.0), {**_record("B1", 8, 30.0, 1.0), "failed": 1}]
    assert "\n\n" not in render(records)
