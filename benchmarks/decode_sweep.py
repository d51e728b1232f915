"""Decode-kernel sweep: tilings and schedules of the Triton decode kernel against the engine's
default setting, timed per layer by CUDA-graph replay on the issue's shapes (rows x context).

Owns: the candidates (`TILING_CANDIDATES`, `PROGRAMS_PER_SM`) and the sweep's stages; the summary
(tables and the JSON to paste) is `decode_sweep_report.py`. Must not: assert correctness
(tests/kernels does; scripts/gpu_decode_sweep.sh runs the GPU tests in the same call) or change a
default itself.

Every timed call is one decode-only pass over `layers` layers of distinct KV (>= 256 MiB in all,
so the L2 cannot hold it), exactly as the engine calls the backend per layer (KV write included),
with page tables padded to the longest context (as the engine's are). Stages:
1. the engine's default setting and every tiling with the default schedule, every shape;
2. the best tilings with every programs-per-SM value (deduplicated by the split count it gives);
3. the best setting with the KV write as its own launch (what fusing it saves).
A time budget (--budget-s) cuts stages 2 and 3 short; the summary uses what was measured.

Usage: python -m benchmarks.decode_sweep [--budget-s 230] [--out FILE] [--rows 1,8,32,128]
           [--contexts 512,640,2048,8192] [--top 3] [--kv-cache-dtype auto|fp8]
       python -m benchmarks.decode_sweep --smoke   (tiny shapes in the CPU interpreter)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.decode_sweep_report import BASELINE
from benchmarks.graph_replay import replay_ms
from benchmarks.kernel_bench import (
    SMOKE_SETTINGS,
    BenchSettings,
    KernelShape,
    Workload,
    build_workload,
)
from loopserve.config import KV_CACHE_DTYPES
from loopserve.kernels.decode_plan import DecodeSchedule, DecodeTiling
from loopserve.kv.storage import special_cache_dtype

LANES = DecodeTiling(tensor_cores=False, heads_per_program=1, block_n=32)
DOTS = DecodeTiling(tensor_cores=True, heads_per_program=16, block_n=64)


def _lanes(**changes: Any) -> DecodeTiling:
    return dataclasses.replace(LANES, **changes)


def _dots(**changes: Any) -> DecodeTiling:
    return dataclasses.replace(DOTS, **changes)


# Tilings fix a row's bits, so one is chosen per model shape. Names: path, tokens per tile (n),
# warps (w), tiles in flight (s), smallest partition (p). All compile for sm_90a with triton 3.6
# without spills (`python -m benchmarks.decode_compile`).
TILING_CANDIDATES: dict[str, DecodeTiling] = {
    "lanes-n32-w4-s3": LANES,
    "lanes-n16-w4-s3": _lanes(block_n=16),
    "lanes-n16-w4-s4": _lanes(block_n=16, num_stages=4),
    "lanes-n16-w2-s4": _lanes(block_n=16, num_warps=2, num_stages=4),
    "lanes-n64-w4-s3": _lanes(block_n=64),
    "lanes-n64-w4-s2": _lanes(block_n=64, num_stages=2),
    "lanes-n64-w8-s3": _lanes(block_n=64, num_warps=8),
    "lanes-n128-w8-s2": _lanes(block_n=128, num_warps=8, num_stages=2),
    "lanes-n32-w2-s3": _lanes(num_warps=2),
    "lanes-n32-w8-s3": _lanes(num_warps=8),
    "lanes-n32-w4-s1": _lanes(num_stages=1),
    "lanes-n32-w4-s2": _lanes(num_stages=2),
    "lanes-n32-w4-s4": _lanes(num_stages=4),
    "lanes-n32-w4-s3-p64": _lanes(partition_min=64),
    "lanes-n32-w4-s3-p32": _lanes(partition_min=32),
    "lanes-n16-w4-s3-p32": _lanes(block_n=16, partition_min=32),
    "lanes-n32-w4-s3-p256": _lanes(partition_min=256),
    "lanes-n32-w4-s3-p512": _lanes(partition_min=512),
    "lanes-n32-w4-s3-p1024": _lanes(partition_min=1024),
    "dots-n64-w4-s3": DOTS,
    "dots-n32-w4-s3": _dots(block_n=32),
    "dots-n64-w8-s3": _dots(num_warps=8),
    "dots-n128-w4-s2": _dots(block_n=128, num_stages=2),
}
# Schedules depend on the row count only: programs per SM the grid aims at (0: one per row).
PROGRAMS_PER_SM = (0.0, 1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True, slots=True)
class Variant:
    """One thing to time: the backend's default setting (tiling None) or a tiling under a
    schedule."""

    name: str  # the tiling's name in TILING_CANDIDATES, or BASELINE
    tiling: DecodeTiling | None
    schedule: DecodeSchedule = dataclasses.field(default_factory=DecodeSchedule)
    covers: tuple[float, ...] = ()  # the PROGRAMS_PER_SM values that give the same split count


@dataclass(frozen=True, slots=True)
class Sweep:
    """Where and what to sweep."""

    settings: BenchSettings
    rows: tuple[int, ...] = (1, 8, 32, 128)
    contexts: tuple[int, ...] = (512, 640, 2048, 8192)
    top: int = 3  # tilings that get the schedule stage
    budget_s: float = 230.0
    num_sms: int = 132


def fixed_schedule(
    programs_per_sm: float, fuse_kv_write: bool = True, last_program_combines: bool = False
) -> DecodeSchedule:
    """The same programs per SM for every row count."""
    return DecodeSchedule(((1 << 30, programs_per_sm),), fuse_kv_write, last_program_combines)


def decode_bytes(rows: int, context: int, shape: KernelShape) -> int:
    """Bytes a decode layer must move: K/V read (in the cache's dtype), q read, out written, new
    K/V written."""
    element = torch.empty((), dtype=shape.dtype).element_size()
    stored = torch.empty((), dtype=shape.cache_dtype).element_size()
    kv_read = 2 * rows * context * shape.num_kv_heads * shape.head_dim * stored
    query_and_out = 2 * shape.num_heads * element
    return kv_read + rows * shape.head_dim * (query_and_out + 2 * shape.num_kv_heads * stored)


@dataclass(slots=True)
class ShapeWorkload(Workload):
    reference: torch.Tensor | None = None  # [T, Nq, D] the default setting's output, last layer


def _workload(rows: int, context: int, sweep: Sweep) -> ShapeWorkload:
    """Decode rows of `context` tokens, page tables padded to the longest swept context (as the
    engine's are), and the default setting's output as the reference."""
    settings = sweep.settings
    built = build_workload([context] * rows, [1] * rows, settings)
    workload = ShapeWorkload(**{f.name: getattr(built, f.name) for f in dataclasses.fields(built)})
    width = -(-max(sweep.contexts) // settings.shape.block_size)
    table = workload.metadata.page_table
    padded = torch.nn.functional.pad(table, (0, width - table.shape[1]))  # null page 0
    workload.metadata = dataclasses.replace(workload.metadata, page_table=padded)
    step, _ = _step(workload, Variant(BASELINE, None))
    step()
    workload.reference = workload.out.clone()
    return workload


def _step(workload: ShapeWorkload, variant: Variant) -> tuple[Callable[[], None], int]:
    """(one pass over the workload's layers with the variant, programs per row it uses)."""
    spec = workload.backend.spec
    backend = (
        type(workload.backend)(spec)
        if variant.tiling is None
        else type(workload.backend)(
            spec, decode_tiling=variant.tiling, decode_schedule=variant.schedule
        )
    )

    def step() -> None:
        for layer in range(workload.layers):
            backend.forward_into(
                workload.q, workload.k, workload.v, workload.kv, layer, workload.metadata,
                workload.out,
            )  # fmt: skip

    return step, backend.decode_split_programs(workload.metadata)


def measure(
    workload: ShapeWorkload, variant: Variant, rows: int, context: int, sweep: Sweep
) -> dict[str, object]:
    """One JSON record: µs per layer, TB/s and fraction of the copy ceiling, the largest
    difference of the last layer's output to the default setting's (`workload.reference`; relative:
    over its largest magnitude), or the error."""
    from benchmarks.kernel_bench import COPY_BANDWIDTH

    record: dict[str, object] = {"bench": "decode_sweep", "variant": variant.name}
    record |= {"rows": rows, "context": context, "layers_per_call": workload.layers}
    if variant.tiling is not None:
        record["tiling"] = dataclasses.asdict(variant.tiling)
        record["schedule"] = dataclasses.asdict(variant.schedule)
        record["covers_programs_per_sm"] = list(variant.covers)
    try:
        step, splits = _step(workload, variant)
        timer = replay_ms if sweep.settings.device.type == "cuda" else _wall_ms
        seconds = timer(step) / 1e3 / workload.layers
        assert workload.reference is not None
        reference = workload.reference.float()
        difference = (workload.out.float() - reference).abs().max().item()
        relative = difference / max(reference.abs().max().item(), 1e-6)
    except Exception as error:  # one bad variant must not hide the others
        return record | {"error": repr(error)[:500]}
    moved = decode_bytes(rows, context, sweep.settings.shape)
    return record | {
        "splits": splits,
        "us": seconds * 1e6,
        "tbps": moved / seconds / 1e12,
        "fraction_of_copy": moved / seconds / COPY_BANDWIDTH,
        "max_abs_diff_vs_before": difference,
        "relative_diff_vs_before": relative,  # over the default output's largest magnitude
    }


def _wall_ms(step: Callable[[], object]) -> float:
    """The interpreter (a code-path check, not a measurement): one call's wall time."""
    start = time.perf_counter()
    step()
    return (time.perf_counter() - start) * 1e3


def run_stage(
    variants_for: Callable[[int, int], Iterable[Variant]],
    sweep: Sweep,
    emit: Callable[[dict], None],
    deadline: float,
) -> list[dict]:
    """Time `variants_for(rows, context)` on every shape (one workload alive at a time)."""
    records = []
    for rows in sweep.rows:
        for context in sweep.contexts:
            variants = list(variants_for(rows, context))
            if not variants or time.monotonic() > deadline:
                continue
            workload = _workload(rows, context, sweep)
            for variant in variants:
                if time.monotonic() > deadline:
                    break
                records.append(measure(workload, variant, rows, context, sweep))
                emit(records[-1])
            del workload
            if sweep.settings.device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def split_groups(tiling: DecodeTiling, rows: int, sweep: Sweep) -> dict[int, tuple[float, ...]]:
    """Split count -> the PROGRAMS_PER_SM values that give it (for the padded page tables)."""
    shape = sweep.settings.shape
    table_tokens = -(-max(sweep.contexts) // shape.block_size) * shape.block_size
    partitions = tiling.partitions_bound(table_tokens)
    head_programs = tiling.head_programs(shape.num_heads, shape.num_kv_heads)
    groups: dict[int, tuple[float, ...]] = {}
    for per_sm in PROGRAMS_PER_SM:
        schedule = fixed_schedule(per_sm)
        splits = schedule.num_split_programs(rows, head_programs, partitions, sweep.num_sms)
        groups[splits] = (*groups.get(splits, ()), per_sm)
    return groups


def _default_splits(tiling: DecodeTiling, rows: int, sweep: Sweep) -> int:
    shape = sweep.settings.shape
    table_tokens = -(-max(sweep.contexts) // shape.block_size) * shape.block_size
    return DecodeSchedule().num_split_programs(
        rows,
        tiling.head_programs(shape.num_heads, shape.num_kv_heads),
        tiling.partitions_bound(table_tokens),
        sweep.num_sms,
    )


def stage_one(
    sweep: Sweep, tilings: dict[str, DecodeTiling]
) -> Callable[[int, int], list[Variant]]:
    """The default setting and every tiling under the default schedule."""

    def variants_for(rows: int, context: int) -> list[Variant]:
        variants = [Variant(BASELINE, None)]
        for name, tiling in tilings.items():
            covers = split_groups(tiling, rows, sweep).get(_default_splits(tiling, rows, sweep))
            variants.append(Variant(name, tiling, covers=covers or ()))
        return variants

    return variants_for


def stage_two(sweep: Sweep, names: list[str], tilings: dict[str, DecodeTiling]) -> Callable:
    """The schedules stage one did not measure, for the tilings `names`: every split count, and
    with the last program combining where rows are shared."""

    def variants_for(rows: int, context: int) -> list[Variant]:
        variants = []
        for name in names:
            tiling = tilings[name]
            measured = _default_splits(tiling, rows, sweep)
            for splits, covers in split_groups(tiling, rows, sweep).items():
                if splits != measured:
                    variants.append(Variant(name, tiling, fixed_schedule(covers[0]), covers))
                if splits > 1:
                    schedule = fixed_schedule(covers[0], last_program_combines=True)
                    variants.append(Variant(name, tiling, schedule, covers))
        return variants

    return variants_for


def stage_three(
    sweep: Sweep, name: str, tiling: DecodeTiling, per_rows: dict[int, float], last: bool
) -> Callable:
    """The chosen setting with the KV write as a separate launch."""

    def variants_for(rows: int, context: int) -> list[Variant]:
        schedule = fixed_schedule(per_rows[rows], False, last)
        return [Variant(f"{name} (separate kv_write)", tiling, schedule, (per_rows[rows],))]

    return variants_for


def run_sweep(sweep: Sweep, emit: Callable[[dict], None], tilings=None) -> list[dict]:
    """All stages within the budget; the records of every measurement."""
    from benchmarks import decode_sweep_report as report

    tilings = tilings or TILING_CANDIDATES
    deadline = time.monotonic() + sweep.budget_s
    records = run_stage(stage_one(sweep, tilings), sweep, emit, deadline)
    ranked = report.rank_tilings(records, sweep.rows, sweep.contexts)
    records += run_stage(stage_two(sweep, ranked[: sweep.top], tilings), sweep, emit, deadline)
    choice = report.choose(records, sweep.rows, sweep.contexts)
    if choice is not None:
        name, per_rows, last = choice
        stage = stage_three(sweep, name, tilings[name], per_rows, last)
        records += run_stage(stage, sweep, emit, deadline)
    return records


def _sweep_from_args(args: argparse.Namespace) -> Sweep:
    kv_dtype = special_cache_dtype(args.kv_cache_dtype)
    if args.smoke:
        shape = dataclasses.replace(SMOKE_SETTINGS.shape, kv_dtype=kv_dtype)
        settings = dataclasses.replace(SMOKE_SETTINGS, shape=shape)
        return Sweep(settings, rows=(1, 3), contexts=(24, 40), top=1, budget_s=600, num_sms=1)
    from benchmarks.kernel_bench import cuda_timer

    device = torch.device("cuda")
    shape = KernelShape(kv_dtype=kv_dtype)
    settings = BenchSettings(device, cuda_timer, shape, min_working_set=256 * 2**20)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = tuple(int(x) for x in args.rows.split(","))
    contexts = tuple(int(x) for x in args.contexts.split(","))
    return Sweep(settings, rows, contexts, args.top, args.budget_s, num_sms)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import decode_sweep_report as report
    from benchmarks.kernel_bench import _environment

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--contexts", default="512,640,2048,8192")
    parser.add_argument("--top", type=int, default=3, help="tilings that get the schedule stage")
    parser.add_argument("--budget-s", type=float, default=230.0, help="stop starting new timings")
    parser.add_argument("--out", help="also write the JSON lines (records, then summary) here")
    parser.add_argument("--tables", help="also write the printed tables here")
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
        help="fp8: an e4m3 cache (scales 1); TB/s count its bytes",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the CPU interpreter")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --smoke)")
    sweep = _sweep_from_args(args)
    environment = _environment(sweep.settings.device)
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(args.out, "w")) if args.out else None

        def emit(record: dict) -> None:
            line = json.dumps(record | environment)
            print(line, flush=True)
            if sink is not None:
                sink.write(line + "\n")
                sink.flush()

        tilings = SMOKE_TILINGS if args.smoke else TILING_CANDIDATES
        records = run_sweep(sweep, emit, tilings)
        text = report.tables(records, sweep.rows, sweep.contexts)
        print(text, flush=True)
        if args.tables:
            with open(args.tables, "w") as tables:
                tables.write(text + "\n")
        summary = report.summary(records, sweep.rows, sweep.contexts, tilings)
        emit(summary)
    return 0 if summary.get("tiling") else 1


SMOKE_TILINGS = {  # the interpreter: one tiling per path, small tiles
    "lanes-n16-p16": DecodeTiling(False, 1, 16, partition_min=16),
    "dots-n16-p32": DecodeTiling(True, 16, 16, partition_min=32),
}

if __name__ == "__main__":
    if "--smoke" in sys.argv:  # the interpreter must be chosen before the kernels are defined
        os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(main())
