"""`loopserve generate` end to end on the built-in model (what the README's first command runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopserve.entrypoints.cli import main


def test_generate_with_the_builtin_model_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["generate", "--prompt", "def fibonacci(n):", "--prompt-ids", "5,6,7",
         "--max-tokens", "6", "--exit-threshold", "0.5", "--json"]
    )  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["def fibonacci(n):", [5, 6, 7]]
    for record in records:
        assert len(record["token_ids"]) == len(record["exit_depths"]) == 6
        assert record["exit_depths"][0] == 4 and record["finish_reason"] == "length"
    assert records[0]["text"]


def test_generate_reports_bad_input_clearly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["generate", "--prompt-ids", "1,x"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "a"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["generate", "--prompt", "a", "--max-loops", "9"]) == 2
    assert "exceeds the model's loop count" in capsys.readouterr().err
