"""`loopserve bench offline --step-timeline` on the CPU: a KV pool small enough to preempt, one JSON
line per engine step with every field, page counts that balance step by step, a summary whose
groupings each partition the steps, and the profiler window's tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopserve.bench.timeline_summary import GROUPINGS, group_steps
from loopserve.entrypoints.cli import main

FIELDS = {
    "spec", "trial", "step", "t_s", "step_ms", "host_ms", "launch_ms", "wait_ms", "sync",
    "executed", "decode_rows", "rows", "bucket", "graph", "prefill_chunks", "prefill_tokens",
    "table_entries", "slot_starts", "swap_out_requests", "swap_out_pages", "swap_out_bytes",
    "swap_in_requests", "swap_in_pages", "swap_in_bytes", "pages_taken", "pages_released",
    "preemptions", "running", "waiting", "kv_pages_used", "host_swap_pages", "profiled",
    "speculate", "graph_captures",
}  # fmt: skip


def test_timeline_records_every_step_and_its_summary_adds_up(
    tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timeline = tmp_path / "steps.jsonl"
    # 14-token prompts take 1 page per plane, 14 + 11 positions take 2: 12 usable pages hold two
    # prompts but only one request at full length, so the second is preempted as they grow.
    code = main([
        "bench", "offline", "--model", str(tiny_checkpoint), "--device", "cpu",
        "--workload", "14/12", "--concurrency", "3", "--exits", "fixed", "--scheduling", "refill",
        "--trials", "1", "--warmup-output-len", "0", "--num-kv-pages", "13",
        "--kv-growth-estimate", "none",  # vLLM's admission: pages run out as requests grow
        "--step-timeline", str(timeline), "--profile-steps", "2:3",
    ])  # fmt: skip
    assert code == 0
    steps = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert steps and all(set(step) == FIELDS for step in steps)
    assert [step["step"] for step in steps] == list(range(len(steps)))
    assert [step["profiled"] for step in steps[:6]] == [False, False, True, True, True, False]
    assert sum(step["preemptions"] for step in steps) > 0
    assert sum(step["swap_out_pages"] for step in steps) == sum(s["swap_in_pages"] for s in steps)
    assert any(step["sync"] for step in steps)
    for step in steps:
        assert step["step_ms"] >= step["launch_ms"] + step["wait_ms"] >= 0
        assert step["graph"] is False and step["graph_captures"] == 0  # CPU: eager
        assert step["speculate"] is False
        assert step["rows"] >= step["decode_rows"]
    used = 0  # the trial starts with an empty cache (no warm-up)
    for step in steps:
        used += step["pages_taken"] - step["pages_released"]
        assert step["kv_pages_used"] == used
    assert used == 0 and steps[-1]["host_swap_pages"] == 0

    measured = [step for step in steps if not step["profiled"]]
    grouped = group_steps(measured)
    assert set(grouped) == set(GROUPINGS)
    total = sum(step["step_ms"] for step in measured)
    for groups in grouped.values():
        assert sum(group.steps for group in groups.values()) == len(measured)
        assert sum(group.total_ms for group in groups.values()) == pytest.approx(total)
    assert grouped["swap"]["swap-out"].steps > 0

    out = capsys.readouterr().out
    assert "### Step timeline: fixed/refill/eager/full 14/12 C=3 max_num_seqs=3" in out
    assert f"{len(measured)} steps over 1 trial(s); 3 profiled steps left out" in out
    assert (tmp_path / "steps-summary.md").read_text() in out
    profile = (tmp_path / "steps-profile.txt").read_text()
    assert "steps 2..4" in profile and "sorted by cpu_time_total" in profile


def test_timeline_says_which_decode_step_ran(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """With speculation and its off-switch at one request, the steps with more than one
    decoding request run the plain step and the others the speculating one (one prompt per
    step: the first request decodes alone before the second joins it, and after it ends)."""
    timeline = tmp_path / "steps.jsonl"
    code = main([
        "bench", "offline", "--model", str(tiny_checkpoint), "--device", "cpu",
        "--workload", "14/12", "--concurrency", "2", "--exits", "fixed", "--scheduling", "refill",
        "--trials", "1", "--warmup-output-len", "0", "--step-timeline", str(timeline),
        "--max-num-batched-tokens", "14",
        "--speculative-config", '{"num_speculative_tokens": 2, "disable_by_batch_size": 1}',
    ])  # fmt: skip
    assert code == 0
    steps = [json.loads(line) for line in timeline.read_text().splitlines()]
    decoding = [step for step in steps if step["decode_rows"]]
    assert {step["speculate"] for step in decoding} == {True, False}
    for step in decoding:
        assert step["speculate"] == (step["decode_rows"] <= 1)
    grouped = group_steps(steps)["decode step"]
    assert {"speculating", "plain"} <= set(grouped)
