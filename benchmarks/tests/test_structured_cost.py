"""The constrained-decoding cost benchmark on the built-in model (CPU): both variants run the same
number of tokens (every request ends by length, which `run_closed_loop` checks) and it reports a
ratio for each point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.structured_cost import main
from loopserve.models.builtin import BUILTIN_MODEL_DIR


def test_structured_cost_rehearsal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the engine's torch path: fast here
    out = tmp_path / "cost.jsonl"
    code = main(
        [
            "--model", str(BUILTIN_MODEL_DIR), "--tokenizer",
            str(BUILTIN_MODEL_DIR / "tokenizer.json"), "--device", "cpu", "--dtype", "float32",
            "--workload", "16/8", "--concurrency", "2", "--exits", "trace", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["concurrency"] == 2 and row["exits"] == "trace"
    assert row["free_tok_s"] > 0 and row["constrained_tok_s"] > 0
    assert row["grammar_host_ms_per_step"] > 0
