"""A per-step timeline of the offline benchmark: one JSON line per `Engine.step` of every trial.

Owns: `StepTimeline` (`loopserve bench offline --step-timeline PATH`), which drives a trial's
engine steps, times each one and writes what it did: wall time split into host work (scheduling,
applying results), launching on the runner and waiting for results; decode rows and the CUDA graph
bucket; prompt tokens; pages taken and given back; swaps; forced read-backs; preemptions; queue
lengths; and on CUDA the caching allocators' device and pinned-host allocations. Optionally it
wraps a window of steps in torch.profiler (`--profile-steps START:COUNT`). Must not: change what
a step does or add a device synchronisation: every figure is something the host already knows.

Every fact comes through public interfaces: the engine's scheduler, KV manager and
`last_step_synced`, the `TimedRunner` the engine drives (`EngineSettings.timed`), and the runner's
`graphs` and `swap`. With asynchronous scheduling a step launches its own work and
waits for the step before it, so the device time of step n shows up in the wait of step n + 1.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.profiler import ProfilerActivity, profile

from loopserve.bench.engine_pool import BuiltEngine
from loopserve.bench.timed_runner import TimedRunner
from loopserve.bench.timeline_summary import summarize
from loopserve.engine.engine import Engine
from loopserve.engine.scheduler_output import SchedulerOutput
from loopserve.outputs import RequestOutput
from loopserve.runner.cuda_graphs import row_bucket

# The device caching allocator's cumulative counters diffed per step: cudaMalloc and cudaFree
# calls, and allocations retried after freeing every cached block (which synchronises).
DEVICE_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


@dataclass(frozen=True, slots=True)
class ProfileWindow:
    """Steps [start, start + count) of the first trial that reaches `start` run under
    torch.profiler; their summary tables go to `path`, their trace beside it (`.trace.json`)."""

    start: int
    count: int
    path: Path

    @staticmethod
    def parse(text: str, path: Path) -> ProfileWindow:
        start, _, count = text.partition(":")
        window = ProfileWindow(int(start), int(count or 30), path)
        if window.start < 0 or window.count < 1:
            raise ValueError("--profile-steps is START:COUNT with START >= 0 and COUNT >= 1")
        return window


class StepTimeline:
    """Writes the steps of every measured trial to one JSON-lines file, keeps them for the
    summary, and runs the profiler window."""

    def __init__(self, path: Path, profile_window: ProfileWindow | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("w", buffering=1)  # line by line: a cut run keeps its steps
        self._window = profile_window  # until it starts
        self._profiling: tuple[profile, ProfileWindow, str] | None = None  # while it runs
        self.records: list[dict[str, Any]] = []

    def stepper(
        self, built: BuiltEngine, label: str, trial: int
    ) -> Callable[[], list[RequestOutput]]:
        """The step function of one trial's closed loop: `built.engine.step`, recorded."""
        if built.timed is None:
            raise ValueError("the step timeline needs an engine built with a TimedRunner")
        return _TrialSteps(self, built, built.timed, label, trial).step

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")

    def profile_before(self, step: int, device: torch.device, what: str) -> bool:
        """Start the profiler window if it starts at `step` and has not run yet (it runs once);
        whether this step runs under the profiler."""
        window = self._window
        if window is not None and step == window.start and self._profiling is None:
            self._profiling = (_start_profiler(device), window, what)
            self._window = None
        return self._profiling is not None

    def profile_after(self, step: int) -> None:
        """Stop the profiler and write its tables once the window's last step has run."""
        if self._profiling is not None:
            window = self._profiling[1]
            if step + 1 >= window.start + window.count:
                self._write_profile()

    @property
    def profile_pending(self) -> bool:
        """The window never started: no trial reached its first step."""
        return self._window is not None

    def summary(self) -> str:
        return summarize(self.records)

    def close(self) -> None:
        if self._profiling is not None:  # the trial ended inside the window
            self._write_profile()
        self._file.close()

    def _write_profile(self) -> None:
        assert self._profiling is not None
        profiler, window, what = self._profiling
        self._profiling = None
        profiler.stop()
        averages = profiler.key_averages()
        last = window.start + window.count - 1
        sections = [f"# torch.profiler over steps {window.start}..{last} of {what}"]
        for sort in ("cuda_time_total", "cpu_time_total", "self_cpu_time_total"):
            sections.append(f"## sorted by {sort}\n{averages.table(sort_by=sort, row_limit=40)}")
        window.path.parent.mkdir(parents=True, exist_ok=True)
        window.path.write_text("\n\n".join(sections) + "\n")
        profiler.export_chrome_trace(str(window.path.with_suffix(".trace.json")))


class _TrialSteps:
    """One trial: each call runs one engine step and writes its record."""

    def __init__(
        self, timeline: StepTimeline, built: BuiltEngine, timed: TimedRunner, label: str, trial: int
    ) -> None:
        self.timeline = timeline
        self.engine: Engine = built.engine
        self.runner = built.runner
        self.timed = timed
        self.label = label
        self.trial = trial
        self.device = torch.device(built.engine.info.device)
        self.max_rows = built.engine.config.scheduler.max_num_seqs
        self.bytes_per_page = built.engine.info.kv_bytes_per_page
        self.index = 0
        self.started = time.perf_counter()

    def step(self) -> list[RequestOutput]:
        engine, timed, kv = self.engine, self.timed, self.engine.kv
        what = f"{self.label} trial {self.trial}"
        profiled = self.timeline.profile_before(self.index, self.device, what)
        before = (timed.launch_s, timed.wait_s, timed.executed, kv.pages_taken, kv.pages_released)
        preemptions = engine.scheduler.stats.preemptions
        allocator = _allocator_counters(self.device)
        captured = self.runner.graphs_captured
        begin = time.perf_counter()
        outputs = engine.step()
        wall = time.perf_counter() - begin
        launch, wait = timed.launch_s - before[0], timed.wait_s - before[1]
        executed = timed.executed > before[2]
        after = _allocator_counters(self.device)
        record: dict[str, Any] = {
            "spec": self.label,
            "trial": self.trial,
            "step": self.index,
            "t_s": begin - self.started,
            "step_ms": 1000 * wall,
            "host_ms": 1000 * (wall - launch - wait),
            "launch_ms": 1000 * launch,
            "wait_ms": 1000 * wait,
            "sync": engine.last_step_synced,
            "executed": executed,
            **self._work(timed.last_scheduled if executed else None),
            "pages_taken": kv.pages_taken - before[3],
            "pages_released": kv.pages_released - before[4],
            "preemptions": engine.scheduler.stats.preemptions - preemptions,
            "running": len(engine.scheduler.running),
            "waiting": len(engine.scheduler.waiting),
            "kv_pages_used": kv.num_used_pages,
            "host_swap_pages": self.runner.swap.num_saved_pages,
            "graph_captures": self.runner.graphs_captured - captured,
            "profiled": profiled,
            **{name: after[name] - allocator[name] for name in after},
        }
        self.timeline.write(record)
        self.timeline.profile_after(self.index)
        self.index += 1
        return outputs

    def _work(self, scheduled: SchedulerOutput | None) -> dict[str, Any]:
        """What the runner was given this step (all zeros when it ran nothing)."""
        if scheduled is None:
            scheduled = SchedulerOutput(step=0)
        slots = list(scheduled.decode_slots)
        rows = max(slots) + 1 if slots else 0
        swap_out = [len(move.page_ids) for move in scheduled.swap_out]
        swap_in = [len(move.page_ids) for move in scheduled.swap_in]
        chunks = scheduled.prefill_chunks
        return {
            "decode_rows": len(slots),
            "rows": rows,
            # The bucket the CUDA-graph rule gives these rows, and whether this run replayed a
            # graph (graphs off, or not CUDA: no).
            "bucket": row_bucket(rows, self.max_rows) if rows else None,
            "graph": rows > 0 and self.runner.graphs is not None,
            "speculate": scheduled.speculate,
            "prefill_chunks": len(chunks),
            "prefill_tokens": sum(len(chunk.token_ids) for chunk in chunks),
            "table_entries": sum(len(update.page_ids) for update in scheduled.page_updates),
            "slot_starts": len(scheduled.slot_starts),
            "swap_out_requests": len(swap_out),
            "swap_out_pages": sum(swap_out),
            "swap_out_bytes": sum(swap_out) * self.bytes_per_page,
            "swap_in_requests": len(swap_in),
            "swap_in_pages": sum(swap_in),
            "swap_in_bytes": sum(swap_in) * self.bytes_per_page,
        }


def _allocator_counters(device: torch.device) -> dict[str, float]:
    """Cumulative counters of the CUDA caching allocators: device (`DEVICE_COUNTERS`) and, where
    this torch reports them, pinned host memory (blocks created and returned, and the time spent
    creating them); none on the CPU."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    counters = {f"cuda_{name}": float(stats.get(name, 0)) for name in DEVICE_COUNTERS}
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    if host_stats is not None:
        host = host_stats()
        counters["pinned_num_host_alloc"] = float(host.get("num_host_alloc", 0))
        counters["pinned_num_host_free"] = float(host.get("num_host_free", 0))
        counters["pinned_alloc_ms"] = float(host.get("host_alloc_time.total", 0)) / 1000
    return counters


def _start_profiler(device: torch.device) -> profile:
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    profiler.start()
    return profiler
