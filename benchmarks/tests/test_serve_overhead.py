"""The server-overhead instrument at toy size on the CPU: a served and an offline wave of the same
workload, each reporting its tokens and where the engine's step time went (its steps timed in the
server's engine process, the default, or in its engine thread), and a summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serve_overhead import main


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_serve_overhead_rehearsal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    pytest.importorskip("fastapi", reason="the server needs the `serve` extra")
    pytest.importorskip("aiohttp", reason="loopserve bench serve needs aiohttp")
    from loopserve.models.checkpoint_writer import write_random_checkpoint
    from loopserve.models.families import preset_config

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the engine's torch path: fast here
    model = tmp_path / "tiny"
    write_random_checkpoint(model, preset_config("tiny", {}))
    out = tmp_path / "overhead.jsonl"
    code = main([
        "--model", str(model), "--device", "cpu", "--threads", "1", "--workload", "8/4",
        "--concurrency", "4", "--rounds", "1", "--out", str(out),
        *(["--engine-thread"] if engine == "thread" else []),
    ])  # fmt: skip
    assert code == 0
    *runs, summary = [json.loads(line) for line in out.read_text().splitlines()]
    assert [run["run"] for run in runs] == ["offline", "serve", "serve", "offline"]
    for run in runs:
        assert run["output_tokens"] == 2 * 4 * 4 and run["steps"] > 0
        assert 0 <= run["engine_off_cpu"] < 1 and run["step_cpu_ms"] > 0
    # (thread CPU times from /proc count in clock ticks: a toy run's loop may show none)
    assert all(run["failed"] == 0 and run["loop_cpu_us_per_token"] >= 0 for run in runs[1:3])
    assert all(run["engine"] == engine for run in runs[1:3])
    separate = [run["engine_process_cpu_us_per_token"] is not None for run in runs[1:3]]
    assert separate == [engine == "process"] * 2
    assert summary["run"] == "summary" and summary["serve_over_offline"] > 0
    assert summary["engine"] == engine
