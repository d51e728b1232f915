"""The kernel benchmark's code path on tiny shapes (interpreter on a CPU), so the GPU run works."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

from benchmarks import kernel_bench as bench
from loopserve.kernels.paged_decode import DecodeTiling
from loopserve.kernels.paged_prefill import PrefillTiling


def _one_call_timer(fn: Callable[[], object]) -> dict[str, float]:
    """`wall_timer`'s figures from one call, not three: on a CPU each call is the interpreter
    running the same kernels again (the smoke run: 8 s -> 4 s). `wall_timer` is tested below."""
    start = time.perf_counter()
    fn()
    ms = (time.perf_counter() - start) * 1e3
    return {"ms": ms, "graph_ms": ms, "graph_p20_ms": ms, "graph_p80_ms": ms}


def test_smoke_run_emits_one_record_per_config(device: torch.device) -> None:
    timer = bench.cuda_timer if device.type == "cuda" else _one_call_timer
    settings = dataclasses.replace(bench.SMOKE_SETTINGS, device=device, timer=timer)
    lines: list[str] = []
    records = bench.run(bench.smoke_configs(), settings, lines.append)
    assert len(lines) == len(list(bench.smoke_configs())) == len(records)
    for line in lines:
        record = json.loads(line)
        assert "error" not in record, record
        assert record["triton_graph_ms"] > 0 and record["sdpa_graph_ms"] > 0
        assert record["max_abs_diff_vs_sdpa"] < 0.05  # bf16 against SDPA in fp32 math
        assert {"git_sha", "device", "triton", "dtype", "tiling"} <= record.keys()


def test_wall_timer_reports_the_median_of_three_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 0.005, 1.0, 1.001, 2.0, 2.003])  # calls of 5, 1 and 3 ms
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    calls: list[None] = []
    figures = bench.wall_timer(lambda: calls.append(None))
    assert len(calls) == 3
    assert figures == pytest.approx(
        {"ms": 3.0, "graph_ms": 3.0, "graph_p20_ms": 1.0, "graph_p80_ms": 5.0}
    )
    assert figures.keys() == _one_call_timer(lambda: None).keys()


def test_standard_configs_are_well_formed() -> None:
    """Every config names a bench function and tiling fields that exist."""
    decode, prefill = DecodeTiling.for_shape(1, 128), PrefillTiling.for_shape(128, torch.bfloat16)
    for quick in (True, False):
        for function, args, tiling in bench.configs(quick):
            assert function in (bench.bench_decode, bench.bench_prefill)
            if function is bench.bench_decode:
                dataclasses.replace(decode, **tiling)
            else:
                dataclasses.replace(prefill, **tiling)
            assert all(isinstance(value, int) for value in (*args, *tiling.values()))
