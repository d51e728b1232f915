"""Offline throughput: the matched closed-loop protocol (docs/benchmarks.md) on random weights.

`loopserve bench offline` keeps C requests in flight (2 × C per trial, random prompts, EOS
ignored), sweeps workloads × concurrency × exits (fixed depth; a trace, by default the model
family's: d2.6 for Ouro) × scheduling (refill, no_refill) × CUDA graphs, and prints one JSON line
per configuration with medians and spread of every figure and the ratio to the bandwidth floor,
then a markdown summary. `--plot` draws throughput vs concurrency; `--ab` alternates the variants
trial by trial (A B B A); `--preset issue3` runs GPU issue 3's table. See docs/benchmarks.md.

Owns: the wiring (plan, checkpoint, calibration, sweep, summary, plot); its flags are
`bench.offline_args`'s. Must not: hold benchmark logic of its own; every piece lives in its
module under loopserve.bench.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

from loopserve.bench.offline_args import add_arguments
from loopserve.bench.presets import PRESETS
from loopserve.bench.records import Record, json_line
from loopserve.bench.sweep_spec import (
    EXITS,
    GRAPHS,
    KV_ALLOCATIONS,
    KV_LAYOUTS,
    ON_OFF,
    PREEMPTION_MODES,
    SCHEDULINGS,
    RunSpec,
    SpecResult,
    Variant,
    Workload,
    grid,
    parse_concurrency,
    parse_list,
)
from loopserve.config import EngineConfig
from loopserve.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from loopserve.bench.engine_pool import EngineSettings
    from loopserve.bench.step_timeline import StepTimeline

__all__ = ["add_arguments", "make_plan", "run"]

SWEEP_FLAGS = (
    "workload", "concurrency", "exits", "scheduling", "graphs", "trials", "prefix_caching",
    "kv_allocation", "preemption_mode", "shared_prefix",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Plan:
    specs: list[RunSpec]
    time_budget_s: float | None


def make_plan(args: argparse.Namespace, device_type: str) -> Plan:
    """The specs to run on this device. CUDA graphs exist only on CUDA: on the CPU every spec
    runs eager and specs that become identical are run once."""
    specs, budget = _requested_specs(args)
    if device_type == "cuda":
        return Plan(specs, budget)
    if any(spec.variant.graphs for spec in specs):
        _say("CUDA graphs do not apply on the CPU: graphs-on configurations run eager")
    eager = [replace(spec, variant=replace(spec.variant, graphs=False)) for spec in specs]
    first = {(spec.variant, spec.point): spec for spec in reversed(eager)}
    return Plan([spec for spec in eager if first[(spec.variant, spec.point)] is spec], budget)


def _requested_specs(args: argparse.Namespace) -> tuple[list[RunSpec], float | None]:
    EngineConfig(  # KV cache and weight settings refused now, not after the checkpoint
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        quantization=args.quantization,
    )  # fmt: skip
    layouts = parse_list(args.kv_layout, KV_LAYOUTS, "--kv-layout")
    if args.preset is not None:
        given = [f"--{name}" for name in SWEEP_FLAGS if getattr(args, name) is not None]
        if given or len(layouts) > 1:
            raise ValueError(
                f"--preset {args.preset} fixes the sweep; drop {given or '--kv-layout'}"
            )
        preset = PRESETS[args.preset](layouts[0])
        budget = args.time_budget if args.time_budget is not None else preset.time_budget_s
        _say(
            f"preset {args.preset}: {preset.description}; {len(preset.specs)} configurations, "
            f"time budget {budget:.0f} s"
        )
        return preset.specs, budget
    # Reserved pages are never preempted: a reserve variant takes no preemption mode (swap, the
    # default, whatever --preemption-mode lists), and appears once.
    variants = list(
        dict.fromkeys(
            Variant(
                exits,
                scheduling,
                graphs == "on",
                layout,
                caching == "on",
                allocation,
                mode if allocation == "incremental" else "swap",
            )
            for exits in parse_list(args.exits or ",".join(EXITS), EXITS, "--exits")
            for scheduling in parse_list(
                args.scheduling or ",".join(SCHEDULINGS), SCHEDULINGS, "--scheduling"
            )
            for graphs in parse_list(args.graphs or ",".join(GRAPHS), GRAPHS, "--graphs")
            for layout in layouts
            for caching in parse_list(args.prefix_caching or "on", ON_OFF, "--prefix-caching")
            for allocation in parse_list(
                args.kv_allocation or "incremental", KV_ALLOCATIONS, "--kv-allocation"
            )
            for mode in parse_list(
                args.preemption_mode or "swap", PREEMPTION_MODES, "--preemption-mode"
            )
        )
    )
    shared = args.shared_prefix or 0
    workloads = [
        replace(Workload.parse(text), shared_prefix=shared) for text in args.workload or ["512/128"]
    ]
    if any(not 0 <= shared < workload.prompt_len for workload in workloads):
        raise ValueError("--shared-prefix must be at least 0 and shorter than every prompt")
    concurrencies = parse_concurrency(args.concurrency or "1,8,32,128")
    SpeculativeConfig.parse(args.speculative_config)  # refused now, not after the checkpoint
    trials = 3 if args.trials is None else args.trials
    if trials < 1 or (args.warmup_output_len is not None and args.warmup_output_len < 0):
        raise ValueError("--trials must be at least 1 and --warmup-output-len at least 0")
    return grid(
        workloads, concurrencies, variants, trials, args.warmup_output_len
    ), args.time_budget


class RecordSink:
    """Prints every record as one JSON line and appends it to `--output` if given."""

    def __init__(self, path: Path | None) -> None:
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("w")

    def emit(self, record: Record) -> None:
        line = json_line(record)
        print(line, flush=True)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def run(args: argparse.Namespace) -> int:
    import torch

    from loopserve.runner.setup import resolve_device

    started = time.monotonic()
    device = resolve_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    plan = make_plan(args, device.type)
    timeline = _timeline(args)
    sink = RecordSink(args.output)
    try:
        results = _measure(args, plan, device, sink, started, timeline)
    finally:
        sink.close()
        if timeline is not None:
            timeline.close()
    if not results:
        _say("nothing was measured")
        return 1
    _report(args, results, timeline)
    return 0


def _timeline(args: argparse.Namespace) -> StepTimeline | None:
    from loopserve.bench.step_timeline import ProfileWindow, StepTimeline

    path: Path | None = args.step_timeline
    if path is None:
        if args.profile_steps is not None:
            raise ValueError("--profile-steps needs --step-timeline")
        return None
    window = None
    if args.profile_steps is not None:
        profile_path = path.with_name(f"{path.stem}-profile.txt")
        window = ProfileWindow.parse(args.profile_steps, profile_path)
    return StepTimeline(path, window)


def _measure(
    args: argparse.Namespace,
    plan: Plan,
    device: torch.device,
    sink: RecordSink,
    started: float,
    timeline: StepTimeline | None,
) -> list[SpecResult]:
    from loopserve.bench.calibration import measure_ceilings
    from loopserve.bench.checkpoint_cache import ensure_random_checkpoint
    from loopserve.bench.engine_pool import EnginePool
    from loopserve.bench.sweep import SweepRunner
    from loopserve.models.loader import resolve_dtype

    model = args.model or str(ensure_random_checkpoint())
    dtype_name = (
        args.dtype if args.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    )
    _say(f"measuring copy bandwidth and matmul FLOP/s on {device} ...")
    ceilings = measure_ceilings(device, resolve_dtype(dtype_name))
    settings = replace(_engine_settings(args, plan, device, model), timed=bool(timeline))
    # Fixed-depth runs give every token explicit depths; the distribution is the trace's.
    base = _base_record(args, device, model) | {
        "trace_distribution": list(settings.trace_distribution)
    }
    pool = EnginePool(settings)
    runner = SweepRunner(
        pool,
        ceilings,
        lambda record: sink.emit(base | record),
        workloads=sorted({spec.point.workload for spec in plan.specs}),
        temperature=args.temperature,
        seed=args.seed,
        deadline=None if plan.time_budget_s is None else started + plan.time_budget_s,
        timeline=timeline,
    )
    try:
        return runner.run_ab(plan.specs) if args.ab else runner.run(plan.specs)
    finally:
        pool.close()


def _base_record(args: argparse.Namespace, device: torch.device, model: str) -> Record:
    """What every record of this run shares: provenance and the run's mode."""
    from loopserve.bench.provenance import describe

    provenance = describe(device)
    return {
        "bench": "offline",
        "git_sha": provenance.git_sha,
        "git_dirty": provenance.git_dirty,
        "device": provenance.device,
        "torch": provenance.torch_version,
        "cuda": provenance.cuda_version,
        "model": model,
        "preset": args.preset,
        "ab": args.ab,
    }


def _engine_settings(
    args: argparse.Namespace, plan: Plan, device: torch.device, model: str
) -> EngineSettings:
    from loopserve.bench.engine_pool import EngineSettings

    max_seqs = args.max_num_seqs or max(spec.point.concurrency for spec in plan.specs)
    return EngineSettings(
        model=model,
        device=str(device),
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        quantization=args.quantization,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or max(2048, max_seqs),
        prefill_chunk_size=args.prefill_chunk_size,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        num_kv_pages=args.num_kv_pages,
        seed=args.seed,
        trace_distribution=_trace_distribution(args, model),
        batch_invariant=args.batch_invariant,
        speculative_config=args.speculative_config,
        kv_growth_estimate=args.kv_growth_estimate,
    )


def _trace_distribution(args: argparse.Namespace, model: str) -> tuple[float, ...]:
    """`--trace-distribution`, or the model family's default trace."""
    from loopserve.depth.trace import check_distribution, resolve_distribution
    from loopserve.models.builtin import resolve_model_dir
    from loopserve.models.families import read_model_config

    config = read_model_config(resolve_model_dir(model) / "config.json")
    given: tuple[float, ...] = ()
    if args.trace_distribution is not None:
        given = tuple(float(value) for value in args.trace_distribution.split(","))
        check_distribution(given, normalized=True)
    return resolve_distribution(given, config.family, config.num_loops)


def _report(
    args: argparse.Namespace, results: list[SpecResult], timeline: StepTimeline | None
) -> None:
    from loopserve.bench.summary import summary_markdown

    summary = summary_markdown(results)
    print(summary, flush=True)
    if args.summary is not None:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(summary)
    if timeline is not None:
        steps = timeline.summary()
        print(steps, flush=True)
        path = timeline.path.with_name(f"{timeline.path.stem}-summary.md")
        path.write_text(steps)
        _say(f"wrote {timeline.path} and {path}")
        if timeline.profile_pending:
            _say("--profile-steps: no trial reached the window's first step; nothing was profiled")
    if args.plot is not None:
        from loopserve.bench.plot import plot_throughput

        _say(f"wrote {plot_throughput(results, args.plot)}")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
