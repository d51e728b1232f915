"""`loopserve bench compare`: runs of two source trees matched by configuration."""

from __future__ import annotations

import json
from pathlib import Path

from loopserve.entrypoints.cli import main


def _write(path: Path, tok_s: float, concurrency: int = 1) -> Path:
    config = {
        "workload": "512/128", "concurrency": concurrency, "exits": "fixed",
        "scheduling": "refill", "graphs": True, "kv_layout": "full",
    }  # fmt: skip
    figures = {"output_tok_s": tok_s, "tpot_p50_ms": 1000 / tok_s, "ttft_p50_ms": 40.0}
    lines = [{"record": "floor"}, {"record": "offline", "config": config, "figures": figures}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_compare_reports_ratio_and_noise(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    a = [_write(tmp_path / "a1", 100.0), _write(tmp_path / "a2", 102.0)]
    b = [_write(tmp_path / "b1", 150.0), _write(tmp_path / "b2", 152.0)]
    output = tmp_path / "table.md"
    argv = ["bench", "compare", "--labels", "before,after", "--output", str(output), "--a"]
    assert main([*argv, *map(str, a), "--b", *map(str, b)]) == 0
    table = output.read_text()
    row = next(line for line in table.splitlines() if line.startswith("| 512/128"))
    assert "100.00 / 102.00" in row and "150.00 / 152.00" in row and "1.495×" in row
    assert "1.000× (noise)" in row  # TTFT did not move
    assert table in capsys.readouterr().out
