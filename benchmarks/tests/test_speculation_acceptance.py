"""`benchmarks.speculation_acceptance` runs end to end on the built-in model: one row per
(threshold, K, d), every output identical to decoding without speculation, and fixed depth
proposes (the model's tokens do not exit before d loops there)."""

from __future__ import annotations

import json

import pytest

from benchmarks import speculation_acceptance


def test_every_configuration_is_identical_to_plain_decoding(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # an engine test: torch attention
    assert speculation_acceptance.main(["--prompts", "2", "--tokens", "8"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(speculation_acceptance.THRESHOLDS) * len(speculation_acceptance.PAIRS)
    assert all(row["identical"] for row in rows)
    fixed = [row for row in rows if row["threshold"] == 1.0]
    assert all(row["proposed"] > 0 and row["step_ratio"] < 1.0 for row in fixed)
