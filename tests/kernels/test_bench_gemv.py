"""The decode-matmul benchmark's code path on tiny shapes (interpreter on a CPU), so the GPU run
works: one record per (projection, M), the table, the arguments."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loopserve.bench import gemv as bench
from loopserve.models.ouro_config import OuroConfig


def test_ouro_projections_are_the_fused_shapes() -> None:
    assert bench.ouro_projections(OuroConfig()) == {
        "qkv": (6144, 2048),
        "o": (2048, 2048),
        "gate_up": (11264, 2048),
        "down": (2048, 5632),
    }


def test_smoke_run_reports_every_projection_and_row_count(device: torch.device) -> None:
    timer = bench.cuda_timer if device.type == "cuda" else bench.wall_timer
    settings = dataclasses.replace(bench.smoke_settings(), device=device, timer=timer)
    records = []
    assert bench.run(settings, records.append) == records
    assert [(r["projection"], r["m"]) for r in records] == [
        (name, m) for name in bench.SMOKE_PROJECTIONS for m in settings.rows
    ]
    for record in records:
        assert len(record["triton"]) == len(bench.tilings())
        assert all("error" not in entry for entry in record["triton"]), record["triton"]
        assert record["winner"] in ("triton", "cublas") and record["cublas_us"] > 0
        n, k = bench.SMOKE_PROJECTIONS[record["projection"]]
        inputs = record["m"] * k * (2 if record["projection"] == "down" else 1)
        assert record["bytes"] == 2 * (n * k + inputs + record["m"] * n)
    table = bench.markdown(records).splitlines()
    assert len(table) == 2 + len(records)
    assert table[2].startswith("| qkv | 1 |")


def test_arguments() -> None:
    args = bench.parse_args(["--rows", "1,8", "--projections", "o,down"])
    assert args.rows == [1, 8] and args.projections == "o,down"
    with pytest.raises(SystemExit):
        bench.parse_args(["--projections", "lm_head"])
