"""`bench/depth_gain.py`: a timeline's trace-exit runs against its fixed-depth runs, on records
whose answer is known by construction."""

from __future__ import annotations

from typing import Any

import pytest

from loopserve.bench.depth_gain import depth_gain_section, depth_gains
from loopserve.bench.timeline_summary import summarize


def step(spec: str, trial: int, ms: float, rows: int, prompt_tokens: int = 0) -> dict[str, Any]:
    return {
        "spec": spec, "trial": trial, "step": 0, "step_ms": ms, "host_ms": 0.0,
        "launch_ms": ms, "wait_ms": 0.0, "sync": False, "executed": True, "decode_rows": rows,
        "rows": rows, "bucket": rows, "graph": True, "prefill_chunks": int(prompt_tokens > 0),
        "prefill_tokens": prompt_tokens, "swap_out_requests": 0, "swap_in_requests": 0,
        "swap_out_bytes": 0, "swap_in_bytes": 0, "preemptions": 0, "running": rows,
        "waiting": 0, "kv_pages_used": 0, "profiled": False,
    }  # fmt: skip


def run(exits: str, trials: int, decode_steps: int, decode_ms: float) -> list[dict[str, Any]]:
    """Per trial: one 10 ms prompt step carrying 8 decode rows, then `decode_steps` steps of 8."""
    spec = f"{exits}/refill/graphs/full 32/8 C=8 max_num_seqs=8"
    records = []
    for trial in range(1, trials + 1):
        records.append(step(spec, trial, 10.0, 8, prompt_tokens=256))
        records += [step(spec, trial, decode_ms, 8) for _ in range(decode_steps)]
    return records


def test_gain_splits_into_decode_only_steps_and_prompt_steps() -> None:
    # Fixed: 4 loops a token, 40 decode steps of 1 ms; trace: 2 loops, 20 steps of 1.1 ms. Row
    # loops (decode rows summed, prompt step included): 8 * 41 against 8 * 21.
    records = run("fixed", 1, 40, 1.0) + run("trace", 2, 20, 1.1)  # trials are averaged
    (gain,) = depth_gains(records)
    assert gain.spec == "refill/graphs/full 32/8 C=8 max_num_seqs=8"
    assert gain.bound == pytest.approx(41 / 21)
    assert gain.gain == pytest.approx(50 / 32)
    assert gain.decode_gain == pytest.approx(40 / 22)
    assert gain.fixed.prompt_s == gain.trace.prompt_s == pytest.approx(0.010)
    assert gain.bound_with_prompts == pytest.approx(50 / (10 + 40 / (41 / 21)))
    section = depth_gain_section(records)
    assert "| refill/graphs/full 32/8 C=8 max_num_seqs=8 | 1.952× | 0.05 → 0.03 |" in section
    assert section in summarize(records)


def test_no_section_without_a_pair() -> None:
    records = run("fixed", 1, 4, 1.0) + run("trace", 1, 0, 1.0)  # the trace run never decoded
    assert depth_gains(records) == []
    assert depth_gain_section(records) == ""
    assert "Depth batching" not in summarize(run("fixed", 1, 4, 1.0))
