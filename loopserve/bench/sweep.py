"""Runs the run specs of an offline sweep: warm-up, trials, one JSON record per spec.

Owns: the order of engine work (a plain sweep reuses one engine per contiguous run of specs; an
A/B sweep alternates its variants trial by trial, A B B A, with all their engines alive), the time
budget, and assembling each result record. Must not: parse arguments or print tables (offline.py
and summary.py do).

Every spec gets its own warm-up wave (C requests; graph capture and compilation happen there)
before its trials; each trial is a closed loop of 2 × C requests. Trial t of every variant at a
point uses the same requests (same prompts and seeds), so variants are compared on equal work.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from loopserve.bench.closed_loop import RequestSpec, make_requests, run_closed_loop
from loopserve.bench.engine_pool import (
    BuiltEngine,
    EnginePool,
    model_bytes,
    peak_memory_bytes,
    reset_peak_memory,
)
from loopserve.bench.figures import Figure, aggregate, trial_figures
from loopserve.bench.floor import Ceilings, ModelBytes
from loopserve.bench.records import (
    Record,
    engine_fields,
    floor_fields,
    floor_record,
    spec_config,
)
from loopserve.bench.step_timeline import StepTimeline
from loopserve.bench.sweep_spec import Point, RunSpec, SpecResult, Workload


class SweepRunner:
    """Runs specs on engines from `pool` and hands every record to `emit`."""

    def __init__(
        self,
        pool: EnginePool,
        ceilings: Ceilings,
        emit: Callable[[Record], None],
        *,
        workloads: list[Workload],
        temperature: float,
        seed: int,
        deadline: float | None,
        timeline: StepTimeline | None = None,
    ) -> None:
        self.pool = pool
        self.timeline = timeline
        self.ceilings = ceilings
        self.emit = emit
        self.temperature = temperature
        self.seed = seed
        self.deadline = deadline
        self.workloads = workloads
        self._model: ModelBytes | None = None
        self._tags = itertools.count()

    # ----- the two orders --------------------------------------------------------------------

    def run(self, specs: list[RunSpec]) -> list[SpecResult]:
        """Specs in the given order; consecutive specs on the same engine share it."""
        results = []
        for index, spec in enumerate(specs):
            if self._out_of_time(specs[index:]):
                break
            results.append(self._run_spec(spec))
        return results

    def run_ab(self, specs: list[RunSpec]) -> list[SpecResult]:
        """At each point, every variant's trials interleaved: A B, B A, A B, ..."""
        points: dict[Point, list[RunSpec]] = {}
        for spec in specs:
            points.setdefault(spec.point, []).append(spec)
        groups = list(points.values())
        results: list[SpecResult] = []
        for index, group in enumerate(groups):
            if self._out_of_time([spec for later in groups[index:] for spec in later]):
                break
            results += self._run_alternating(group)
        return results

    # Engines are only ever held by the pool and by the locals of the two methods below, so that
    # the pool can free an engine's device memory before it builds the next one.

    def _run_spec(self, spec: RunSpec) -> SpecResult:
        built = self.pool.open([spec.variant.engine_key])[spec.variant.engine_key]
        self._warm_up(built, spec)
        trials = [self._trial(built, spec, trial) for trial in range(spec.trials)]
        return self._finish(built, spec, trials, order=None)

    def _run_alternating(self, group: list[RunSpec]) -> list[SpecResult]:
        engines = self.pool.open([spec.variant.engine_key for spec in group])
        for spec in group:
            self._warm_up(engines[spec.variant.engine_key], spec)
        trials: list[list[dict[str, Figure]]] = [[] for _ in group]
        order: list[str] = []
        for trial in range(max(spec.trials for spec in group)):
            forward = list(enumerate(group))
            for index, spec in forward if trial % 2 == 0 else reversed(forward):
                trials[index].append(self._trial(engines[spec.variant.engine_key], spec, trial))
                order.append(chr(ord("A") + index))
        return [
            self._finish(engines[spec.variant.engine_key], spec, trials[index], "".join(order))
            for index, spec in enumerate(group)
        ]

    # ----- one spec ------------------------------------------------------------------------

    def _out_of_time(self, remaining: list[RunSpec]) -> bool:
        if self.deadline is None or time.monotonic() < self.deadline or not remaining:
            return False
        _say(f"time budget exceeded: skipping the {len(remaining)} remaining configuration(s)")
        for spec in remaining:
            self.emit({"record": "skipped", "config": self._config(spec), "reason": "time budget"})
        return True

    def _requests(
        self, built: BuiltEngine, spec: RunSpec, tag: int, count: int, output_len: int
    ) -> list[RequestSpec]:
        workload = spec.point.workload
        model_config = built.engine.model_config
        return make_requests(
            replace(workload, output_len=output_len),
            count,
            seed=(self.seed, tag, spec.point.concurrency, workload.prompt_len, workload.output_len),
            vocab_size=model_config.vocab_size,
            num_loops=model_config.num_loops,
            exits=spec.variant.exits,
            temperature=self.temperature,
        )

    def _warm_up(self, built: BuiltEngine, spec: RunSpec) -> None:
        if spec.warmup_output_len == 0:
            return
        concurrency = spec.point.concurrency
        requests = self._requests(built, spec, 0, concurrency, spec.warmup_output_len)
        run_closed_loop(built.engine, requests, concurrency, f"warmup{next(self._tags)}")

    def _trial(self, built: BuiltEngine, spec: RunSpec, trial: int) -> dict[str, Figure]:
        concurrency = spec.point.concurrency
        output_len = spec.point.workload.output_len
        requests = self._requests(built, spec, trial + 1, 2 * concurrency, output_len)
        device = torch.device(built.engine.info.device)
        reset_peak_memory(device)
        step = None
        if self.timeline is not None:
            slots = built.engine.config.scheduler.max_num_seqs
            label = (
                f"{spec.variant.label(with_layout=True)} {spec.point.workload.name} "
                f"C={concurrency} max_num_seqs={slots}"
            )
            step = self.timeline.stepper(built, label, trial + 1)
        record = run_closed_loop(
            built.engine, requests, concurrency, f"trial{next(self._tags)}", step
        )
        peak = peak_memory_bytes(device)
        figures = trial_figures(record, self._model_bytes(built), self.ceilings)
        if peak is not None:
            figures["peak_gpu_memory_gib"] = peak / 2**30
        _say(
            f"  {spec.variant.label(with_layout=True)} {spec.point.workload.name} "
            f"C={concurrency} trial {trial + 1}/{spec.trials}: "
            f"{figures['output_tok_s']:.1f} output tok/s, floor ratio "
            f"{figures['floor_ratio']:.2f} ({record.duration_s:.1f} s)"
        )
        return figures

    def _model_bytes(self, built: BuiltEngine) -> ModelBytes:
        if self._model is None:
            self._model = model_bytes(built.runner)
            loops = built.engine.model_config.num_loops
            floor = floor_record(self._model, self.ceilings, loops, self.workloads)
            self.emit(floor)
        return self._model

    def _finish(
        self,
        built: BuiltEngine,
        spec: RunSpec,
        trials: list[dict[str, Figure]],
        order: str | None,
    ) -> SpecResult:
        medians, spread = aggregate(trials)
        record = {
            "record": "offline",
            "config": self._config(spec) | engine_fields(built),
            "figures": medians,
            "spread": spread,
            "trial_output_tok_s": [trial["output_tok_s"] for trial in trials],
            "floor": floor_fields(self.ceilings),
            "engine_startup_s": built.startup_s,
        }
        if order is not None:
            record["ab_order"] = order
        self.emit(record)
        return SpecResult(spec, medians, spread, built.engine.model_config.num_loops)

    def _config(self, spec: RunSpec) -> Record:
        return spec_config(spec, temperature=self.temperature, seed=self.seed)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
