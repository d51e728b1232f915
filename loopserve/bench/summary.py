"""The markdown summary of an offline sweep: the table, ratios within the run, the issue's targets.

Owns: formatting results as markdown (one row per variant, the KV layout a column of its own, so
`--kv-layout full,shared` never prints two rows under one label), pairing variants that differ in
one setting (trace/fixed, refill/no_refill, graphs/eager; within one layout) and saying whether a
ratio is beyond the noise, and evaluating
the targets of GPU issue 3 where the sweep has the data. Must not: assert or fail on any figure;
targets are reported as met or missed, nothing more.

Noise (docs/benchmarks.md): a difference smaller than the spread (max − min over trials) of either
variant is noise; with a single trial the spread is unknown and the column says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from loopserve.bench.figures import Figure
from loopserve.bench.sweep_spec import EXITS, Point, SpecResult, Variant


@dataclass(frozen=True, slots=True)
class Pairing:
    axis: str  # the Variant field that differs
    top: str | bool  # its value in the numerator
    bottom: str | bool
    title: str


PAIRINGS = (
    Pairing("exits", "trace", "fixed", "trace / fixed depth"),
    Pairing("scheduling", "refill", "no_refill", "refill / no_refill"),
    Pairing("graphs", True, False, "graphs / eager"),
    Pairing("prefix_caching", True, False, "prefix cache on / off"),
    Pairing("kv_allocation", "incremental", "reserve", "incremental pages / reserved"),
    Pairing("preemption_mode", "recompute", "swap", "recompute / swap preemption"),
)


def summary_markdown(results: list[SpecResult]) -> str:
    ordered = sorted(results, key=_table_order)
    parts = ["## Offline throughput", "", *_table(ordered)]
    for pairing in PAIRINGS:
        rows = _ratio_rows(ordered, pairing)
        if rows:
            parts += ["", f"### {pairing.title} (output tok/s)", "", *rows]
    # Issue 3's targets are Ouro-1.4B's (4 loops); other models' runs are not held to them.
    targets = issue3_targets(ordered) if all(r.num_loops == 4 for r in ordered) else []
    if targets:
        parts += ["", "### GPU issue 3 targets (evaluated, not asserted)", "", *targets]
    return "\n".join(parts) + "\n"


def _table_order(result: SpecResult) -> tuple[object, ...]:
    variant, point = result.spec.variant, result.spec.point
    return (
        point,
        not variant.graphs,
        variant.scheduling != "refill",
        variant.kv_layout,
        EXITS.index(variant.exits),
    )


def _number(value: object, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _table(results: list[SpecResult]) -> list[str]:
    header = (
        "| workload | C | exits | scheduling | graphs | KV | output tok/s [min–max] | "
        "total tok/s | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | floor % | depth | occupancy | "
        "KV peak/total | preemptions |"
    )
    lines = [header, "|" + "---|" * 16]
    for result in results:
        variant, point, figures = result.spec.variant, result.spec.point, result.medians
        low, high = result.spread["output_tok_s"]
        floor = figures["floor_ratio"]
        lines.append(
            f"| {point.workload.name} | {point.concurrency} | {variant.exits} | "
            f"{variant.scheduling} | {'on' if variant.graphs else 'off'} | {_kv(variant)} | "
            f"{_number(figures['output_tok_s'])} [{_number(low)}–{_number(high)}] | "
            f"{_number(figures['total_tok_s'])} | {_number(figures['ttft_p50_ms'])} | "
            f"{_number(figures['tpot_p50_ms'], 2)} | {_number(figures['itl_p50_ms'], 2)} | "
            f"{_number(_percent(floor))} | "
            f"{_number(figures['mean_exit_depth'], 2)} | {_number(figures['occupancy'], 1)} | "
            f"{_number(figures['kv_pages_peak'], 0)}/{_number(figures['kv_pages_total'], 0)} | "
            f"{_number(figures.get('preemptions'), 0)} |"
        )
    return lines


def _kv(variant: Variant) -> str:
    """The KV layout, and the KV settings that differ from the defaults."""
    parts = [variant.kv_layout]
    if not variant.prefix_caching:
        parts.append("no prefix cache")
    if variant.kv_allocation != "incremental":
        parts.append(variant.kv_allocation)
    if variant.preemption_mode != "swap":
        parts.append(f"{variant.preemption_mode} preemption")
    return ", ".join(parts)


def _index(results: list[SpecResult]) -> dict[tuple[Point, Variant], SpecResult]:
    return {(result.spec.point, result.spec.variant): result for result in results}


def _ratio_rows(results: list[SpecResult], pairing: Pairing) -> list[str]:
    index = _index(results)
    with_layout = len({result.spec.variant.kv_layout for result in results}) > 1
    rows = []
    for result in results:
        variant = result.spec.variant
        if getattr(variant, pairing.axis) != pairing.top:
            continue
        partner = index.get((result.spec.point, _with(variant, pairing.axis, pairing.bottom)))
        if partner is None:
            continue
        rows.append(_ratio_row(result, partner, pairing, with_layout))
    if not rows:
        return []
    bound = " | bound | of bound" if pairing.axis == "exits" else ""
    header = f"| workload | C | variant | ratio | beyond noise?{bound} |"
    return [header, "|" + "---|" * (header.count("|") - 1), *rows]


def _with(variant: Variant, axis: str, value: str | bool) -> Variant:
    return replace(variant, **{axis: value})  # type: ignore[arg-type]  # axis names a field


def _ratio_row(top: SpecResult, bottom: SpecResult, pairing: Pairing, with_layout: bool) -> str:
    ratio = throughput_ratio(top, bottom)
    others = [
        value
        for name, value in (
            ("exits", top.spec.variant.exits),
            ("scheduling", top.spec.variant.scheduling),
            ("graphs", "graphs" if top.spec.variant.graphs else "eager"),
        )
        if name != pairing.axis
    ]
    if with_layout:
        others.append(_kv(top.spec.variant))
    point = top.spec.point
    row = f"| {point.workload.name} | {point.concurrency} | {'/'.join(others)} | "
    row += f"{_number(ratio, 2)}× | {beyond_noise(top, bottom)} |"
    depth = top.medians["mean_exit_depth"]
    if pairing.axis == "exits" and ratio is not None and depth:
        bound = top.num_loops / float(depth)
        row += f" {bound:.2f}× | {100 * ratio / bound:.0f} % |"
    return row


def throughput_ratio(top: SpecResult, bottom: SpecResult) -> float | None:
    numerator, denominator = top.medians["output_tok_s"], bottom.medians["output_tok_s"]
    if numerator is None or not denominator:
        return None
    return float(numerator) / float(denominator)


def beyond_noise(first: SpecResult, second: SpecResult, figure: str = "output_tok_s") -> str:
    """'yes' if the medians differ by more than either variant's spread, 'noise' if not,
    'unknown (1 trial)' when a spread is not measured."""
    if min(first.spec.trials, second.spec.trials) < 2:
        return "unknown (1 trial)"
    spreads = []
    for result in (first, second):
        low, high = result.spread[figure]
        spreads.append(float(high or 0.0) - float(low or 0.0))
    difference = abs(float(first.medians[figure] or 0.0) - float(second.medians[figure] or 0.0))
    return "yes" if difference > max(spreads) else "noise"


def issue3_targets(results: list[SpecResult]) -> list[str]:
    """GPU issue 3's targets, for those the results can evaluate."""
    find = _finder(results)
    lines = []
    c1 = find("512/128", 1, Variant("fixed", "refill", True, "full"))
    if c1 is not None:
        tpot, floor = c1.medians["tpot_p50_ms"], c1.medians["decode_floor_ms_per_token"]
        ratio = None if not tpot or floor is None else float(floor) / float(tpot)
        met = ratio is not None and tpot is not None and ratio >= 0.75 and tpot <= 3.1
        lines.append(
            f"- {_verdict(met)} C=1 fixed depth 4 with graphs ≥ 75 % of the floor and ≤ 3.1 "
            f"ms/token: TPOT p50 {_number(tpot, 2)} ms against a decode floor of "
            f"{_number(floor, 2)} ms/token = {_number(None if ratio is None else 100 * ratio)} % "
            f"(whole run with prefill: {_number(_percent(c1.medians['floor_ratio']))} %)"
        )
    trace = find("512/128", 32, Variant("trace", "refill", True, "full"))
    fixed = find("512/128", 32, Variant("fixed", "refill", True, "full"))
    cohort = find("512/128", 32, Variant("trace", "no_refill", True, "full"))
    if trace is not None and fixed is not None and cohort is not None:
        speedup, over = throughput_ratio(trace, fixed), throughput_ratio(trace, cohort)
        met = speedup is not None and speedup >= 1.4 and over is not None and over > 1.0
        lines.append(
            f"- {_verdict(met)} C=32 trace refill ≥ 1.4× fixed and clearly above no_refill: "
            f"{_number(speedup, 2)}× fixed, {_number(over, 2)}× no_refill "
            f"(beyond noise: {beyond_noise(trace, cohort)})"
        )
    graphs = find("512/128", 1, Variant("fixed", "refill", True, "full"))
    eager = find("512/128", 1, Variant("fixed", "refill", False, "full"))
    if graphs is not None and eager is not None:
        ratio = throughput_ratio(graphs, eager)
        met = ratio is not None and ratio >= 2.5
        lines.append(f"- {_verdict(met)} C=1 graphs ≥ 2.5× eager: {_number(ratio, 2)}×")
    for graphs_on in (True, False):
        long_prompt = find("1024/128", 1, Variant("fixed", "refill", graphs_on, "full"))
        if long_prompt is not None:
            ttft = long_prompt.medians["ttft_p50_ms"]
            met = ttft is not None and ttft <= 40.0
            lines.append(
                f"- {_verdict(met)} TTFT of one 1024-token prompt at C=1 ≤ 40 ms "
                f"({'graphs' if graphs_on else 'eager'}): p50 {_number(ttft)} ms"
            )
    return lines


def _finder(results: list[SpecResult]) -> Callable[[str, int, Variant], SpecResult | None]:
    by_name = {}
    for result in results:
        point = result.spec.point
        by_name[(point.workload.name, point.concurrency, result.spec.variant)] = result
    return lambda workload, concurrency, variant: by_name.get((workload, concurrency, variant))


def _percent(value: Figure) -> float | None:
    return None if value is None else 100.0 * float(value)


def _verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"
