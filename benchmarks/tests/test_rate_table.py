"""The rate table: a table per label, rows by ascending rate, goodput with its share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.rate_table import main, render


def _run(label: str, rate: float | str, goodput: float | None) -> dict:
    achieved = 2.0 if rate == "inf" else float(rate)
    return {
        "config": {"label": label, "request_rate": rate},
        "completed": 8, "failed": 0, "request_throughput": achieved,
        "output_throughput": 100.0 * achieved,
        "p50_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "p50_tpot_ms": 5.0, "p99_tpot_ms": 6.0,
        "p50_itl_ms": None, "p99_itl_ms": None,
        "request_goodput": goodput, "goodput_targets_ms": {"ttft": 250.0},
    }  # fmt: skip


def test_rows_by_rate_per_label(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = [_run("fixed 512/128", 8.0, 4.0), _run("d2.6 512/128", 2.0, None)]
    runs.append(_run("fixed 512/128", 2.0, 2.0))
    runs.append(_run("fixed 512/128 closed", "inf", 1.0))  # bench serve writes "inf" as text
    text = render(runs)
    assert "## fixed 512/128 closed" in text and "| inf |" in text
    fixed, d26 = text.split("## fixed 512/128 closed")[0].split("## d2.6 512/128")
    assert "(goodput: ttft ≤ 250 ms)" in fixed
    rows = [line for line in fixed.splitlines() if line.startswith("| 2") or line.startswith("| 8")]
    assert [row.split(" | ")[0] for row in rows] == ["| 2", "| 8"]
    assert "| 4.00 (50%) |" in rows[1] and "| 10.0 / 20.0 |" in rows[0]
    assert "| - |" in d26  # no ITL and no goodput: a dash, not a number
    lines = tmp_path / "runs.jsonl"
    lines.write_text("\n".join(json.dumps(run) for run in runs) + "\n")
    assert main([str(lines)]) == 0
    assert capsys.readouterr().out == text
