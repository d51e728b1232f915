"""The sweep plan (grid, issue3 preset, CPU collapse) and the summary's ratios and targets."""

from __future__ import annotations

import argparse

import pytest

from loopserve.bench.figures import FIGURES, Figure
from loopserve.bench.offline import add_arguments, make_plan
from loopserve.bench.presets import issue3
from loopserve.bench.summary import beyond_noise, issue3_targets, summary_markdown
from loopserve.bench.sweep_spec import Point, RunSpec, SpecResult, Variant, Workload


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_issue3_preset_is_the_issue_table_plus_ttft() -> None:
    specs = issue3().specs
    keys = {(spec.variant, spec.point) for spec in specs}
    assert len(keys) == len(specs) == 4 * 2 * 2 * 2 + 2
    for concurrency in (1, 8, 32, 128):
        for exits in ("fixed", "trace"):
            for scheduling in ("refill", "no_refill"):
                for graphs in (True, False):
                    variant = Variant(exits, scheduling, graphs, "full")
                    assert (variant, Point(Workload(512, 128), concurrency)) in keys
    for graphs in (True, False):
        assert (Variant("fixed", "refill", graphs, "full"), Point(Workload(1024, 128), 1)) in keys
    # Graphs first, so a budget that runs out drops eager runs.
    first_eager = next(i for i, spec in enumerate(specs) if not spec.variant.graphs)
    assert all(not spec.variant.graphs for spec in specs[first_eager:])


def test_plan_on_cpu_runs_graphs_variants_once_eager() -> None:
    plan = make_plan(_args("--preset", "issue3"), "cpu")
    assert len(plan.specs) == len(issue3().specs) // 2
    assert not any(spec.variant.graphs for spec in plan.specs)
    assert plan.time_budget_s == issue3().time_budget_s
    cuda = make_plan(_args("--preset", "issue3", "--time-budget", "60"), "cuda")
    assert len(cuda.specs) == len(issue3().specs) and cuda.time_budget_s == 60


def test_plan_grid_and_bad_flags() -> None:
    plan = make_plan(_args("--workload", "8/2", "--concurrency", "1,4", "--exits", "fixed"), "cuda")
    assert len(plan.specs) == 2 * 2 * 2  # C × scheduling × graphs
    assert plan.specs[0].variant.graphs and plan.specs[0].trials == 3
    with pytest.raises(ValueError):
        make_plan(_args("--preset", "issue3", "--concurrency", "1"), "cuda")
    with pytest.raises(ValueError):
        make_plan(_args("--exits", "d3"), "cuda")
    with pytest.raises(ValueError):
        make_plan(_args("--workload", "512"), "cuda")


def test_reserve_runs_once_whatever_preemption_modes_are_listed() -> None:
    """Reserved pages are never preempted: `--preemption-mode recompute` must not drop the reserve
    variant (it did, silently), and swap,recompute must not run it twice."""
    for modes in ("recompute", "swap,recompute"):
        plan = make_plan(
            _args(
                "--workload", "8/2", "--concurrency", "4", "--exits", "fixed", "--scheduling",
                "refill", "--graphs", "on", "--kv-allocation", "reserve,incremental",
                "--preemption-mode", modes,
            ),
            "cuda",
        )  # fmt: skip
        pairs = [(spec.variant.kv_allocation, spec.variant.preemption_mode) for spec in plan.specs]
        incremental = [("incremental", mode) for mode in modes.split(",")]
        assert pairs == [("reserve", "swap"), *incremental]


SHORT = Workload(512, 128)


def _result(
    variant: Variant, concurrency: int, tok_s: tuple[float, float, float], trials: int = 3,
    workload: Workload = SHORT, **figures: Figure,
) -> SpecResult:  # fmt: skip
    medians: dict[str, Figure] = dict.fromkeys(FIGURES, 1.0)
    medians |= {"output_tok_s": tok_s[1], **figures}
    spread: dict[str, list[Figure]] = {name: [medians[name]] * 2 for name in FIGURES}
    spread["output_tok_s"] = [tok_s[0], tok_s[2]]
    spec = RunSpec(variant, Point(workload, concurrency), trials, 16)
    return SpecResult(spec, medians, spread, num_loops=4)


def test_noise_rule() -> None:
    a = _result(Variant("trace", "refill", True, "full"), 32, (138, 140, 142))
    b = _result(Variant("fixed", "refill", True, "full"), 32, (99, 100, 101))
    c = _result(Variant("fixed", "refill", True, "full"), 32, (120, 135, 150))
    assert beyond_noise(a, b) == "yes"
    assert beyond_noise(a, c) == "noise"
    single = _result(Variant("fixed", "refill", True, "full"), 32, (100, 100, 100), trials=1)
    assert beyond_noise(a, single) == "unknown (1 trial)"


def test_summary_ratios_and_issue3_targets() -> None:
    results = [
        _result(Variant("trace", "refill", True, "full"), 32, (138, 140, 142), mean_exit_depth=2.6),
        _result(Variant("fixed", "refill", True, "full"), 32, (99, 100, 101), mean_exit_depth=4.0),
        _result(Variant("trace", "no_refill", True, "full"), 32, (119, 120, 121)),
        _result(Variant("fixed", "refill", True, "full"), 1, (320, 322, 324),
                decode_floor_ms_per_token=2.4, tpot_p50_ms=3.0),
        _result(Variant("fixed", "refill", False, "full"), 1, (99, 100, 101)),
        _result(Variant("fixed", "refill", True, "full"), 1, (300, 300, 300),
                workload=Workload(1024, 128), ttft_p50_ms=45.0),
    ]  # fmt: skip
    text = summary_markdown(results)
    assert "| 512/128 | 32 | refill/graphs | 1.40× | yes | 1.54× | 91 % |" in text
    assert "| 512/128 | 32 | trace/graphs | 1.17× | yes |" in text  # refill / no_refill
    assert "| 512/128 | 1 | fixed/refill | 3.22× | yes |" in text  # graphs / eager
    targets = issue3_targets(results)
    assert len(targets) == 4
    assert targets[0].startswith("- **met** C=1 fixed depth 4")
    assert "decode floor of 2.40 ms/token = 80.0 %" in targets[0]
    assert targets[1].startswith("- **met** C=32 trace refill")
    assert targets[2].startswith("- **met** C=1 graphs ≥ 2.5× eager")
    assert targets[3].startswith("- **missed** TTFT of one 1024-token prompt")


def test_two_layouts_get_their_own_rows_and_ratios() -> None:
    """`--kv-layout full,shared`: each row and each ratio names its layout, none is duplicated."""
    results = [
        _result(Variant(exits, "refill", True, layout), 32, (base, base + 1, base + 2))
        for layout, base in (("full", 100), ("shared", 200))
        for exits in ("fixed", "trace")
    ]
    text = summary_markdown(results)
    table = [line for line in text.splitlines() if line.startswith("| 512/128 | 32 | fixed |")]
    assert [line.split(" | ")[5] for line in table] == ["full", "shared"]
    assert "| 512/128 | 32 | refill/graphs/full | 1.00× |" in text
    assert "| 512/128 | 32 | refill/graphs/shared | 1.00× |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 512/128 |")]
    assert len(rows) == len(set(rows)) == 4 + 2  # 4 table rows, 2 ratio rows
