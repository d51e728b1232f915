"""The decode sweep's choice logic on made-up records, and its code path on tiny shapes (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import decode_sweep as sweep_module
from benchmarks import decode_sweep_report as report
from benchmarks.decode_sweep import Sweep, fixed_schedule, run_sweep
from loopserve.kernels.decode_plan import DecodeSchedule, DecodeTiling
from loopserve.kv.storage import FP8

ROWS, CONTEXTS = (1, 32), (640, 8192)
DEFAULT = dataclasses.asdict(DecodeSchedule())


def _record(name: str, rows: int, context: int, us: float, covers=(), default=False, last=False):
    schedule = dataclasses.asdict(fixed_schedule(covers[0], last_program_combines=last))
    record = {"variant": name, "rows": rows, "context": context, "us": us, "tbps": 1.0}
    record |= {"schedule": DEFAULT if default else schedule, "covers_programs_per_sm": list(covers)}
    # The default schedule's records run one program per row, so they count whether or not
    # the last program combines (the default's own setting).
    return record | {"relative_diff_vs_before": 0.01, "splits": 1 if default else 2}


def _records() -> list[dict]:
    """Tiling A is best under the default schedule; with schedules, B wins at 1 row; the last
    program combining is slower for both."""
    records = []
    for rows in ROWS:
        for context in CONTEXTS:
            records.append(_record(report.BASELINE, rows, context, 100.0, covers=(0.0,)))
            records.append(_record("A", rows, context, 10.0, covers=(4.0,), default=True))
            records.append(_record("B", rows, context, 12.0, covers=(4.0,), default=True))
            records.append(_record("A", rows, context, 11.0, covers=(0.0, 1.0)))
            records.append(_record("B", rows, context, 5.0 if rows == 1 else 20.0, covers=(0.0,)))
            records.append(_record("B", rows, context, 30.0, covers=(4.0,), last=True))
    return records


def test_rank_uses_the_default_schedule() -> None:
    assert report.rank_tilings(_records(), ROWS, CONTEXTS) == ["A", "B"]


def test_choose_picks_one_tiling_and_a_schedule_per_row_count() -> None:
    name, per_rows, last = report.choose(_records(), ROWS, CONTEXTS)
    # B: 5 µs at 1 row (0 programs per SM), 12 at 32 rows (default, 4) -> geomean 7.7 < A's 10
    assert name == "B" and per_rows == {1: 0.0, 32: 4.0} and last is False


def test_choose_takes_the_last_program_combining_when_faster() -> None:
    records = _records() + [
        _record("A", r, c, 1.0, (2.0,), last=True) for r in ROWS for c in CONTEXTS
    ]
    assert report.choose(records, ROWS, CONTEXTS) == ("A", {1: 2.0, 32: 2.0}, True)


def test_wrong_outputs_and_errors_are_not_ranked() -> None:
    records = _records()
    for record in records:
        if record["variant"] == "B":
            record["relative_diff_vs_before"] = float("nan")
    records.append({"variant": "C", "rows": 1, "context": 640, "error": "boom"})
    tilings = {"A": DecodeTiling(False, 1, 32), "B": DecodeTiling(False, 1, 16)}
    summary = report.summary(records, ROWS, CONTEXTS, tilings)
    assert summary["tiling_name"] == "A"
    schedule = {"programs_per_sm": [[1, 4.0], [32, 4.0]], "fuse_kv_write": True}
    assert summary["schedule"] == schedule | {"last_program_combines": False}
    assert "C" in summary["errors"] and any("B" in error for error in summary["errors"])
    DecodeTiling(**summary["tiling"])  # pastes back into the dataclass


def test_tables_show_every_shape() -> None:
    text = report.tables(_records(), ROWS, CONTEXTS)
    assert all(f"{r}x{c}" in text for r in ROWS for c in CONTEXTS)
    assert "chosen: B" in text


def test_split_groups_cover_every_programs_per_sm_once() -> None:
    sweep = Sweep(sweep_module.SMOKE_SETTINGS, rows=(1,), contexts=(640, 8192))
    tiling = sweep_module.LANES
    for rows in (1, 8, 32, 128):
        groups = sweep_module.split_groups(tiling, rows, sweep)
        covered = sorted(x for values in groups.values() for x in values)
        assert covered == sorted(sweep_module.PROGRAMS_PER_SM)
        assert min(groups) == 1 and 0.0 in groups[1]


@pytest.mark.parametrize("kv_dtype", [None, FP8], ids=["auto", "fp8"])
def test_tiny_sweep_runs_every_stage(device: torch.device, kv_dtype: torch.dtype | None) -> None:
    """The interpreter (or a GPU): the old kernel, a tiling, its schedules, the separate write;
    on the model's cache and on an fp8 one."""
    settings = sweep_module.SMOKE_SETTINGS
    shape = dataclasses.replace(settings.shape, kv_dtype=kv_dtype)
    settings = dataclasses.replace(settings, shape=shape)
    if device.type == "cuda":
        settings = dataclasses.replace(settings, device=device)
    sweep = Sweep(settings, rows=(1,), contexts=(24,), top=1, budget_s=600, num_sms=2)
    tilings = {"lanes": DecodeTiling(False, 1, 16, partition_min=16)}
    lines: list[dict] = []
    records = run_sweep(sweep, lines.append, tilings)
    assert lines == records and not [r for r in records if "error" in r]
    variants = {r["variant"] for r in records}
    assert variants == {report.BASELINE, "lanes", "lanes (separate kv_write)"}
    assert all(r["relative_diff_vs_before"] < 0.05 for r in records)
    assert report.summary(records, sweep.rows, sweep.contexts, tilings)["tiling_name"] == "lanes"
    stored = 1 if kv_dtype == FP8 else 2  # the smoke shape's model dtype is bf16
    moved = 2 * 24 * 2 * 32 * stored + 32 * (2 * 2 * 2 + 4 * stored)
    assert sweep_module.decode_bytes(1, 24, shape) == moved
    grouped = dataclasses.replace(shape, num_heads=4)  # 4 query heads share 2 KV heads
    stored_heads = 2 * 24 * 2 * 32 * stored + 32 * 2 * 2 * stored  # K/V read; new K/V written
    assert sweep_module.decode_bytes(1, 24, grouped) == stored_heads + 32 * 2 * 4 * 2  # q, out


def test_default_schedule_at_ouro_shape() -> None:
    """Programs per (row, KV head) on 132 SMs with 8192-token tables (32 partitions)."""
    schedule, head_programs, parts = DecodeSchedule(), 16, 32
    splits = {
        rows: schedule.num_split_programs(rows, head_programs, parts, 132)
        for rows in (1, 8, 16, 32, 128)
    }
    assert splits == {1: 32, 8: 5, 16: 2, 32: 1, 128: 1}
    assert DecodeSchedule(programs_per_sm=((1 << 30, 0.0),)).num_split_programs(1, 16, 32, 132) == 1


def test_tiling_rules() -> None:
    assert DecodeTiling.for_shape(1, 128) == DecodeTiling(False, 1, 32)
    assert DecodeTiling.for_shape(4, 128) == DecodeTiling(True, 16, 64)
    assert DecodeTiling.for_shape(1, 256).block_n == 16
    assert DecodeTiling.for_shape(6, 256) == DecodeTiling(True, 16, 32)
    for bad in (
        {"tensor_cores": True, "heads_per_program": 8, "block_n": 32},  # dots need >= 16 heads
        {"tensor_cores": False, "heads_per_program": 2, "block_n": 32},
        {"tensor_cores": False, "heads_per_program": 1, "block_n": 48},  # not a power of two
        {"tensor_cores": False, "heads_per_program": 1, "block_n": 256},  # > partition_min
    ):
        with pytest.raises(ValueError):
            DecodeTiling(**bad)
    assert DecodeTiling(False, 1, 32).partitions_bound(8192) == 32
    assert DecodeTiling(False, 1, 32).partitions_bound(640) == 5
