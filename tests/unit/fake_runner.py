"""A model-free runner for scheduler tests: exits follow the scheduler's own instructions, and a
scripted gate decides `IF_GATE` rows; every executed row is recorded."""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.engine.kv_manager import KVCacheManager
from loopserve.engine.scheduler import Scheduler
from loopserve.engine.scheduler_config import SchedulerConfig
from loopserve.engine.scheduler_output import (
    DecodeRow,
    ExitCheck,
    RunnerOutput,
    SampledToken,
    SchedulerOutput,
)
from loopserve.outputs import RequestMetrics
from loopserve.request import Request
from loopserve.sampling_params import ResolvedParams, SamplingParams


def make_request(
    request_id: str,
    prompt_len: int = 5,
    max_tokens: int = 4,
    max_loops: int = 4,
    threshold: float = 1.0,
    trace_depths: tuple[int, ...] | None = None,
    priority: int = 0,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, trace_depths=trace_depths)
    resolved = ResolvedParams(params, 0, 1, max_loops, threshold, frozenset())
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=resolved,
        metrics=RequestMetrics(0.0),
        priority=priority,
    )


@dataclass
class FakeRunner:
    # request id -> the loop at which its gate test first holds (IF_GATE rows)
    gate_depth: dict[str, int] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)

    def _gate(self, row: DecodeRow) -> bool:
        return row.loop >= self.gate_depth.get(row.request_id, 99)

    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        self.steps.append(scheduled)
        rows = scheduled.decode_rows
        exited = [
            row.exit is ExitCheck.EXIT or (row.exit is ExitCheck.IF_GATE and self._gate(row))
            for row in rows
        ]
        tokens: list[SampledToken | None] = [
            SampledToken(100 + row.sampling.output_index, None) if done else None
            for row, done in zip(rows, exited, strict=True)
        ]
        prefill: list[SampledToken | None] = [
            SampledToken(100, None) if chunk.completes_prompt else None
            for chunk in scheduled.prefill_chunks
        ]
        return RunnerOutput(
            exited=exited,
            survival=[row.survival for row in rows],
            exit_test=[self._gate(row) for row in rows],
            decode_tokens=tokens,
            prefill_tokens=prefill,
        )


def make_scheduler(num_pages: int = 200, **config: object) -> Scheduler:
    scheduler_config = SchedulerConfig(**config)  # type: ignore[arg-type]
    return Scheduler(scheduler_config, KVCacheManager(num_pages, scheduler_config.block_size))


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return
        scheduled = scheduler.schedule()
        scheduler.update(scheduled, runner.execute(scheduled))
        scheduler.kv.check_invariants()
    raise AssertionError("the scheduler did not finish")
