"""Where the gain of early exit goes: a step timeline's trace-exit runs against fixed depth.

Owns: pairing the specs of a timeline that differ only in their exits (`fixed/...` and
`trace/...`, the rest of the spec equal) and, per pair, splitting the time into steps that only
decode and steps that carry prompt work, against the bound. Must not: import torch (it reads the
plain records of `bench/step_timeline.py`).

The bound is the ratio of loops run: with refill scheduling every decode step runs one loop of
each live row, so the row-loops of a run (its steps' live decode rows, summed) are its tokens
times their mean depth, and fixed over trace row-loops is the 4 / 2.6 = 1.54x the trace allows
(as drawn, not as nominal). Prompts run at full depth in both, so the steps that carry prompt
work cannot gain; with them as measured the best the trace run could do is its prompt steps plus
the fixed run's decode-only time over the bound (`bound with prompt steps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

StepRecord = dict[str, Any]
FIXED, TRACE = "fixed/", "trace/"


@dataclass(frozen=True, slots=True)
class RunTime:
    """One spec's steps, per trial (trials pooled, divided by their number)."""

    seconds: float
    decode_only_s: float
    decode_only_steps: float
    prompt_s: float
    row_loops: float

    @classmethod
    def of(cls, steps: Sequence[StepRecord]) -> RunTime:
        trials = max(len({step["trial"] for step in steps}), 1)
        prompt = [step for step in steps if step["prefill_tokens"] > 0]
        decode = [step for step in steps if step["prefill_tokens"] == 0 and step["decode_rows"]]
        return cls(
            seconds=sum(step["step_ms"] for step in steps) / 1e3 / trials,
            decode_only_s=sum(step["step_ms"] for step in decode) / 1e3 / trials,
            decode_only_steps=len(decode) / trials,
            prompt_s=sum(step["step_ms"] for step in prompt) / 1e3 / trials,
            row_loops=sum(step["decode_rows"] for step in steps) / trials,
        )


@dataclass(frozen=True, slots=True)
class DepthGain:
    spec: str  # the pair's spec without its exits
    fixed: RunTime
    trace: RunTime

    @property
    def bound(self) -> float:
        return self.fixed.row_loops / self.trace.row_loops

    @property
    def gain(self) -> float:
        return self.fixed.seconds / self.trace.seconds

    @property
    def decode_gain(self) -> float:
        return self.fixed.decode_only_s / self.trace.decode_only_s

    @property
    def bound_with_prompts(self) -> float:
        best = self.trace.prompt_s + self.fixed.decode_only_s / self.bound
        return self.fixed.seconds / best


def depth_gains(records: Sequence[StepRecord]) -> list[DepthGain]:
    """One `DepthGain` per pair of specs (profiled steps left out), in the timeline's order."""
    specs: dict[str, list[StepRecord]] = {}
    for record in records:
        if not record["profiled"]:
            specs.setdefault(record["spec"], []).append(record)
    pairs = []
    for spec, steps in specs.items():
        if not spec.startswith(FIXED):
            continue
        rest = spec[len(FIXED) :]
        trace = RunTime.of(specs.get(TRACE + rest, []))
        if trace.row_loops and trace.decode_only_s:  # a trace run that decoded
            pairs.append(DepthGain(rest, RunTime.of(steps), trace))
    return pairs


def depth_gain_section(records: Sequence[StepRecord]) -> str:
    """Markdown: the pairs' table ("" when the timeline holds no pair)."""
    gains = depth_gains(records)
    if not gains:
        return ""
    lines = [
        "### Depth batching: trace exits over fixed depth (per trial)",
        "",
        "| spec | bound (loops) | s fixed → trace | gain | of bound | decode-only steps "
        "| decode-only s | decode-only gain | of bound | prompt-step s | bound with prompt steps "
        "| of it |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for g in gains:
        f, t = g.fixed, g.trace
        lines.append(
            f"| {g.spec} | {g.bound:.3f}× | {f.seconds:.2f} → {t.seconds:.2f} | {g.gain:.3f}× | "
            f"{g.gain / g.bound:.0%} | {f.decode_only_steps:.0f} → {t.decode_only_steps:.0f} | "
            f"{f.decode_only_s:.2f} → {t.decode_only_s:.2f} | {g.decode_gain:.3f}× | "
            f"{g.decode_gain / g.bound:.0%} | {f.prompt_s:.2f} → {t.prompt_s:.2f} | "
            f"{g.bound_with_prompts:.3f}× | {g.gain / g.bound_with_prompts:.0%} |"
        )
    return "\n".join(lines)
