"""The summary of a step timeline (`loopserve bench offline --step-timeline`): where the time went.

Owns: grouping a timeline's steps several ways — by work (decode, decode + prompt, prompt only),
by swap (out, in), by read-back (asynchronous or forced by the scheduler), by decode path (CUDA
graph or eager) and by row bucket — each grouping a partition of the steps, with count, total,
mean and p90 time and the mean host / launch / wait split per group; step-time percentiles; and
the run cut in tenths, to show when a regime starts; and, for specs that differ only in their
exits, where the gain of early exit goes (`bench/depth_gain.py`).
`python -m loopserve.bench.timeline_summary PATH` summarises a timeline file again. Must not:
import torch (it reads plain records).

Steps run under the profiler window are left out (the profiler slows them).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loopserve.bench.depth_gain import depth_gain_section

StepRecord = dict[str, Any]


def _work(step: StepRecord) -> str:
    if not step["executed"]:
        return "nothing launched"
    decode, prompt = step["decode_rows"] > 0, step["prefill_tokens"] > 0
    if decode and prompt:
        return "decode + prompt"
    return "decode" if decode else "prompt" if prompt else "bookkeeping only"


def _swap(step: StepRecord) -> str:
    out, back = step["swap_out_requests"] > 0, step["swap_in_requests"] > 0
    return {
        (False, False): "no swap",
        (True, False): "swap-out",
        (False, True): "swap-in",
        (True, True): "swap-out + swap-in",
    }[(out, back)]


def _read_back(step: StepRecord) -> str:
    return "forced sync (needs_sync)" if step["sync"] else "asynchronous"


def _decode_path(step: StepRecord) -> str:
    if not step["rows"]:
        return "no decode"
    return "CUDA graph" if step["graph"] else "eager"


def _decode_step(step: StepRecord) -> str:
    if not step["rows"]:
        return "no decode"
    return "speculating" if step.get("speculate") else "plain"


def _captures(step: StepRecord) -> str:
    return "captured a graph" if step.get("graph_captures") else "no capture"


def _row_bucket(step: StepRecord) -> str:
    if not step["rows"]:
        return "no decode"
    return f"bucket {step['bucket']:>3}"


# Each grouping sorts every step into exactly one of its groups.
GROUPINGS: dict[str, Callable[[StepRecord], str]] = {
    "work": _work,
    "swap": _swap,
    "read-back": _read_back,
    "decode path": _decode_path,
    "decode step": _decode_step,
    "graph capture": _captures,
    "row bucket": _row_bucket,
}


@dataclass(slots=True)
class Group:
    step_ms: list[float] = field(default_factory=list)
    host_ms: float = 0.0
    launch_ms: float = 0.0
    wait_ms: float = 0.0

    def add(self, step: StepRecord) -> None:
        self.step_ms.append(step["step_ms"])
        self.host_ms += step["host_ms"]
        self.launch_ms += step["launch_ms"]
        self.wait_ms += step["wait_ms"]

    @property
    def steps(self) -> int:
        return len(self.step_ms)

    @property
    def total_ms(self) -> float:
        return sum(self.step_ms)


def group_steps(steps: Sequence[StepRecord]) -> dict[str, dict[str, Group]]:
    """Grouping name -> group name -> its steps (every grouping partitions `steps`)."""
    grouped: dict[str, dict[str, Group]] = {name: {} for name in GROUPINGS}
    for step in steps:
        for name, key in GROUPINGS.items():
            grouped[name].setdefault(key(step), Group()).add(step)
    return {name: dict(sorted(groups.items())) for name, groups in grouped.items()}


def summarize(records: Sequence[StepRecord]) -> str:
    """Markdown: one section per spec (its trials pooled)."""
    specs: dict[str, list[StepRecord]] = {}
    for record in records:
        specs.setdefault(record["spec"], []).append(record)
    sections = [_spec_section(spec, steps) for spec, steps in specs.items()]
    gains = depth_gain_section(records)
    return "\n\n".join([*sections, gains] if gains else sections) + "\n"


def _spec_section(spec: str, records: list[StepRecord]) -> str:
    steps = [record for record in records if not record["profiled"]]
    trials = len({record["trial"] for record in records})
    lines = [
        f"### Step timeline: {spec}",
        "",
        f"{len(steps)} steps over {trials} trial(s)"
        + (f"; {len(records) - len(steps)} profiled steps left out" if len(steps) < len(records)
           else ""),
    ]  # fmt: skip
    if not steps:
        return "\n".join(lines)
    times = np.array([step["step_ms"] for step in steps])
    p50, p90, p99 = np.percentile(times, [50, 90, 99])
    total = {part: sum(step[f"{part}_ms"] for step in steps) / 1000 for part in _PARTS}
    swapped = {way: sum(step[f"swap_{way}_bytes"] for step in steps) / 2**30 for way in _WAYS}
    lines += [
        "",
        f"Engine.step: {times.sum() / 1000:.2f} s in all, mean {times.mean():.2f} ms, p50 "
        f"{p50:.2f}, p90 {p90:.2f}, p99 {p99:.2f}, max {times.max():.2f} ms; host "
        f"{total['host']:.2f} s, launch {total['launch']:.2f} s, wait {total['wait']:.2f} s.",
        f"Forced read-backs {sum(step['sync'] for step in steps)}; preemptions "
        f"{sum(step['preemptions'] for step in steps)}; swapped out {swapped['out']:.2f} GiB in "
        f"{sum(step['swap_out_requests'] for step in steps)} moves, in {swapped['in']:.2f} GiB "
        f"in {sum(step['swap_in_requests'] for step in steps)}.",
        "",
        "| grouping | group | steps | total s | share | mean ms | p90 ms | host ms | launch ms "
        "| wait ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    whole = times.sum()
    for name, groups in group_steps(steps).items():
        for key, group in groups.items():
            n = group.steps
            lines.append(
                f"| {name} | {key} | {n} | {group.total_ms / 1000:.2f} | "
                f"{group.total_ms / whole:.0%} | {group.total_ms / n:.2f} | "
                f"{np.percentile(group.step_ms, 90):.2f} | {group.host_ms / n:.2f} | "
                f"{group.launch_ms / n:.2f} | {group.wait_ms / n:.2f} |"
            )
    return "\n".join([*lines, "", *_tenths(steps)])


_PARTS = ("host", "launch", "wait")
_WAYS = ("out", "in")


def _tenths(steps: list[StepRecord]) -> list[str]:
    """The steps in ten consecutive slices (trials pooled in order): when does a regime start?"""
    lines = [
        "| steps | mean ms | decode rows | eager decode steps | running | waiting | KV pages "
        "| forced syncs | swaps out / in |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    several_trials = len({step["trial"] for step in steps}) > 1
    for part in np.array_split(np.arange(len(steps)), min(10, len(steps))):
        chunk = [steps[i] for i in part]
        n = len(chunk)
        first, last = (
            f"{step['trial']}:{step['step']}" if several_trials else str(step["step"])
            for step in (chunk[0], chunk[-1])
        )
        eager = sum(step["rows"] > 0 and not step["graph"] for step in chunk)
        lines.append(
            f"| {first}..{last} | "
            f"{sum(step['step_ms'] for step in chunk) / n:.2f} | "
            f"{sum(step['decode_rows'] for step in chunk) / n:.1f} | {eager / n:.0%} | "
            f"{sum(step['running'] for step in chunk) / n:.1f} | "
            f"{sum(step['waiting'] for step in chunk) / n:.1f} | "
            f"{sum(step['kv_pages_used'] for step in chunk) / n:.0f} | "
            f"{sum(step['sync'] for step in chunk)} | "
            f"{sum(step['swap_out_requests'] for step in chunk)} / "
            f"{sum(step['swap_in_requests'] for step in chunk)} |"
        )
    return lines


def read_timeline(path: Path) -> list[StepRecord]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise a step timeline (JSON lines).")
    parser.add_argument("timeline", type=Path)
    args = parser.parse_args(argv)
    print(summarize(read_timeline(args.timeline)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
