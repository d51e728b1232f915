"""The real runner, timed: what profilers and the step timeline hand the engine instead of it.

Owns: `TimedRunner`, which forwards every call to a `ModelRunner` and adds up the host time spent
launching steps (`execute`) and waiting for their results (`PendingStep.result`: the device
finishing the step, then the result record's conversion), and remembers the last step it was
given. Must not: change what a step does or synchronise with the device itself.
"""

from __future__ import annotations

import time

from loopserve.engine.runner_api import RunnerInfo
from loopserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from loopserve.runner.model_runner import ModelRunner, PendingOutput


class TimedRunner:
    """The real runner, with the host time spent launching steps and waiting for their results."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.launch_s = 0.0
        self.wait_s = 0.0
        self.executed = 0  # steps launched
        self.last_scheduled: SchedulerOutput | None = None

    @property
    def info(self) -> RunnerInfo:
        return self.runner.info

    def execute(self, scheduled: SchedulerOutput) -> TimedPending:
        started = time.perf_counter()
        pending = self.runner.execute(scheduled)
        self.launch_s += time.perf_counter() - started
        self.executed += 1
        self.last_scheduled = scheduled
        return TimedPending(pending, self)


class TimedPending:
    def __init__(self, pending: PendingOutput, owner: TimedRunner) -> None:
        self._pending = pending
        self._owner = owner

    def result(self) -> RunnerOutput:
        started = time.perf_counter()
        output = self._pending.result()
        self._owner.wait_s += time.perf_counter() - started
        return output
