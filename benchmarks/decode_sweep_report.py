"""The decode sweep's summary: which tiling and schedule won, and tables of what was measured.

Owns: ranking tilings, choosing programs per SM per row count, the printed tables and the summary
record (the JSON to paste into `DecodeTiling.for_shape` and `DecodeSchedule`). Must not: time
anything (decode_sweep.py does); it reads only the sweep's records.

A tiling changes a row's bits, so one tiling must serve every row count: tilings are ranked by the
geometric mean of µs per layer over every shape. Programs per SM does not, so it is chosen per row
count (the geometric mean over that row count's contexts).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from loopserve.kernels.decode_plan import DecodeTiling

BASELINE = "engine default"  # the backend's own tiling and schedule
MAX_DIFFERENCE = 0.05  # relative to the default setting's output (bf16 rounding: ~0.01); over it or
# NaN: the variant is not ranked
# FlashInfer's CUDA-core decode on the same H200 and shapes (µs per layer incl. its KV append),
# measured before this sweep; shown for reference only.
FLASHINFER_US = {
    (1, 640): 6.7,
    (8, 640): 16.9,
    (32, 640): 42.7,
    (128, 640): 159.0,
    (32, 2048): 127.0,
    (1, 8192): 25.1,
    (32, 8192): 488.0,
}
Shape = tuple[int, int]  # (rows, context)


def _geomean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.inf


def _timed(records: list[dict]) -> list[dict]:
    """Measured records whose output agreed with the old kernel's."""
    return [r for r in records if "us" in r and r["relative_diff_vs_before"] <= MAX_DIFFERENCE]


def _times(
    records: list[dict], name: str, per_sm: float | None, last: bool = False
) -> dict[Shape, float]:
    """µs per shape of tiling `name` at `per_sm` programs per SM (None: the default schedule,
    which says itself whether the last program combines), the last program combining shared rows
    or not (one program per row: either)."""
    times: dict[Shape, float] = {}
    for record in _timed(records):
        if record["variant"] != name:
            continue
        if per_sm is None and record["schedule"] != _default_schedule_dict():
            continue
        if per_sm is not None and per_sm not in record["covers_programs_per_sm"]:
            continue
        combines = record["schedule"]["last_program_combines"]
        if per_sm is not None and combines != last and record["splits"] > 1:
            continue
        if record["schedule"]["fuse_kv_write"] is False:
            continue
        shape = (record["rows"], record["context"])
        times[shape] = min(times.get(shape, math.inf), record["us"])
    return times


def _default_schedule_dict() -> dict:
    from loopserve.kernels.decode_plan import DecodeSchedule

    return dataclasses.asdict(DecodeSchedule())


def _shapes(rows: Iterable[int], contexts: Iterable[int]) -> list[Shape]:
    return [(r, c) for r in rows for c in contexts]


def rank_tilings(records: list[dict], rows: tuple, contexts: tuple) -> list[str]:
    """Tiling names measured on every shape under the default schedule, best geomean first."""
    shapes = _shapes(rows, contexts)
    names = {r["variant"] for r in _timed(records) if r["variant"] != BASELINE}
    scores = {}
    for name in names:
        times = _times(records, name, None)
        if all(shape in times for shape in shapes):
            scores[name] = _geomean(times[shape] for shape in shapes)
    return sorted(scores, key=scores.__getitem__)


def _best_per_rows(records: list[dict], name: str, rows: tuple, contexts: tuple, last: bool):
    """{rows: (programs per SM, geomean µs over contexts)} for tiling `name`, where complete."""
    measured = {
        x for r in _timed(records) if r["variant"] == name for x in r["covers_programs_per_sm"]
    }
    best: dict[int, tuple[float, float]] = {}
    for per_sm in sorted(measured):
        times = _times(records, name, per_sm, last)
        for count in rows:
            if all((count, c) in times for c in contexts):
                score = _geomean(times[(count, c)] for c in contexts)
                if score < best.get(count, (0.0, math.inf))[1]:
                    best[count] = (per_sm, score)
    return best


def choose(records: list[dict], rows: tuple, contexts: tuple) -> tuple[str, dict, bool] | None:
    """(tiling name, {rows: programs per SM}, last program combines) with the best geomean over
    every shape."""
    scored = []
    for name in rank_tilings(records, rows, contexts):
        for last in (False, True):
            best = _best_per_rows(records, name, rows, contexts, last)
            if len(best) == len(rows):
                score = _geomean(best[r][1] for r in rows)  # = the geomean over every shape
                scored.append((score, last, name, {r: best[r][0] for r in rows}))
    if not scored:
        return None
    _, last, name, per_rows = min(scored)
    return name, per_rows, last


def _chosen_times(records: list[dict], name: str, per_rows: dict[int, float], last: bool) -> dict:
    times = {}
    for count, per_sm in per_rows.items():
        for shape, us in _times(records, name, per_sm, last).items():
            if shape[0] == count:
                times[shape] = us
    return times


def _separate_write_times(records: list[dict], name: str) -> dict[Shape, float]:
    label = f"{name} (separate kv_write)"
    return {(r["rows"], r["context"]): r["us"] for r in _timed(records) if r["variant"] == label}


def tables(records: list[dict], rows: tuple, contexts: tuple) -> str:
    """Stage one (every tiling, default schedule) and the chosen setting against the old kernel."""
    shapes = _shapes(rows, contexts)
    header = f"{'variant (default schedule), µs per layer':42}" + "".join(
        f"{f'{r}x{c}':>9}" for r, c in shapes
    )
    lines = ["", header + f"{'geomean':>9}"]
    names = [BASELINE, *rank_tilings(records, rows, contexts)]
    for name in names:
        times = _times(records, name, None) if name != BASELINE else _baseline(records)
        cells = "".join(f"{times[s]:9.1f}" if s in times else f"{'-':>9}" for s in shapes)
        lines.append(f"{name:42}{cells}{_geomean(times.values()):9.1f}")
    choice = choose(records, rows, contexts)
    if choice is None:
        return "\n".join([*lines, "", "no tiling measured on every shape"])
    name, per_rows, last = choice
    lines += [
        "",
        f"chosen: {name}, programs per SM by rows {per_rows}, last program combines {last}",
    ]
    lines.append(_final_header())
    chosen, baseline = _chosen_times(records, name, per_rows, last), _baseline(records)
    separate = _separate_write_times(records, name)
    bytes_of = {(r["rows"], r["context"]): r["us"] * r["tbps"] for r in _timed(records)}
    for shape in shapes:
        lines.append(_final_row(shape, chosen, baseline, separate, bytes_of))
    lines += ["", "fastest measured per shape (any tiling and schedule):"]
    for key, best in fastest_per_shape(records).items():
        lines.append(f"{key:>14}  {best['us']:9.1f} µs  {best['variant']} splits={best['splits']}")
    return "\n".join(lines)


def fastest_per_shape(records: list[dict]) -> dict[str, dict]:
    """The fastest agreeing measurement of each shape (any tiling, any schedule): the headroom
    left by choosing one tiling for every shape."""
    fastest: dict[str, dict] = {}
    for record in _timed(records):
        key = f"{record['rows']}x{record['context']}"
        if key not in fastest or record["us"] < fastest[key]["us"]:
            schedule = record.get("schedule", {})
            fastest[key] = {
                "variant": record["variant"],
                "us": round(record["us"], 2),
                "splits": record.get("splits"),
                "programs_per_sm": record.get("covers_programs_per_sm"),
                "last_program_combines": schedule.get("last_program_combines"),
                "fuse_kv_write": schedule.get("fuse_kv_write"),
            }
    return fastest


def _baseline(records: list[dict]) -> dict[Shape, float]:
    return {(r["rows"], r["context"]): r["us"] for r in _timed(records) if r["variant"] == BASELINE}


def _final_header() -> str:
    columns = ["rows x ctx", "before µs", "after µs", "TB/s", "of 4.28", "speedup"]
    columns += ["sep. write µs", "flashinfer µs"]
    return "".join(f"{column:>14}" for column in columns)


def _final_row(shape: Shape, chosen: dict, baseline: dict, separate: dict, bytes_of: dict) -> str:
    def cell(value: float | None, spec: str = "14.1f") -> str:
        return f"{value:{spec}}" if value is not None else f"{'-':>14}"

    after, before = chosen.get(shape), baseline.get(shape)
    tbps = bytes_of[shape] / after if after and shape in bytes_of else None
    speedup = before / after if after and before else None
    return (
        f"{f'{shape[0]}x{shape[1]}':>14}{cell(before)}{cell(after)}{cell(tbps, '14.2f')}"
        f"{cell(tbps / 4.28 if tbps else None, '14.0%')}{cell(speedup, '13.2f')}x"
        f"{cell(separate.get(shape))}{cell(FLASHINFER_US.get(shape))}"
    )


def summary(records: list[dict], rows: tuple, contexts: tuple, tilings: dict) -> dict:
    """The record to paste: the chosen tiling and schedule, and the figures behind them."""
    choice = choose(records, rows, contexts)
    result: dict = {"bench": "decode_sweep_summary", "tiling": None}
    errors = sorted({r["variant"] for r in records if "error" in r})
    wrong = [r for r in records if "us" in r and not r["relative_diff_vs_before"] <= MAX_DIFFERENCE]
    errors += sorted({f"{r['variant']}: output differs from the old kernel's" for r in wrong})
    if choice is None:
        return result | {"errors": errors}
    name, per_rows, last = choice
    tiling: DecodeTiling = tilings[name]
    chosen = _chosen_times(records, name, per_rows, last)
    separate = _separate_write_times(records, name)
    fuse = not separate or _geomean(chosen[s] for s in separate) <= _geomean(separate.values())
    per_shape = {f"{r}x{c}": round(us, 2) for (r, c), us in sorted(chosen.items())}
    baseline = {f"{r}x{c}": round(us, 2) for (r, c), us in sorted(_baseline(records).items())}
    return result | {
        "tiling_name": name,
        "tiling": dataclasses.asdict(tiling),
        "schedule": {
            "programs_per_sm": [[count, per_rows[count]] for count in sorted(per_rows)],
            "fuse_kv_write": fuse,
            "last_program_combines": last,
        },
        "us_per_layer": per_shape,
        "before_us_per_layer": baseline,
        "fastest_per_shape": fastest_per_shape(records),
        "errors": errors,
    }
