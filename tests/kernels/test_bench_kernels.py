"""The kernel benchmark's code path on tiny shapes (interpreter on a CPU), so the GPU run works."""

from __future__ import annotations

import dataclasses
import json

import torch

from loopserve.bench import kernels as bench
from loopserve.kernels.paged_decode import DecodeTiling
from loopserve.kernels.paged_prefill import PrefillTiling


def test_smoke_run_emits_one_record_per_config(device: torch.device) -> None:
    timer = bench.cuda_timer if device.type == "cuda" else bench.wall_timer
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
