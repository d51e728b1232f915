"""Decode-shaped matmuls on one GPU: cuBLAS against the Triton kernel of kernels/gemv.py for each
Ouro-1.4B projection and a few row counts, as a table of microseconds and bandwidth.

Owns: `python -m loopserve.bench.gemv`, the tilings it sweeps and the report (one JSON line per
(projection, M), then a markdown table). Must not: decide anything; `GEMV_MAX_ROWS` in
models/ops.py and `DEFAULT_TILING` in kernels/gemv.py are set by hand from its output (one tiling
per projection for every M: a tiling can change a row's bits, a row count must not).

Method (as loopserve/bench/attention_table.py): one CUDA graph holds one call per weight copy, 24
distinct copies (a loop's worth of layers; every projection's copies exceed the 50 MB L2); the
figure is the median replay over the copies. `cublas` is what `TritonOps` runs instead of the
kernel: F.linear, after the SiLU·up kernel for the down projection (whose Triton kernel does
SiLU·up itself). Bytes moved: the weight, the input rows and the output rows, once; TB/s and the
fraction of the 4.24 TB/s copy bandwidth (docs/latency.md) follow from them.

Usage: python -m loopserve.bench.gemv [--rows 1,2,4,8,16,32] [--projections qkv,o,gate_up,down]
           [--out FILE.jsonl] [--markdown FILE.md]
       python -m loopserve.bench.gemv --smoke  (tiny shapes in the CPU interpreter; code check)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from loopserve.bench.attention_table import parse_list
from loopserve.models.ouro_config import OuroConfig

if TYPE_CHECKING:  # the kernels import triton, and --smoke must set the interpreter first
    from loopserve.kernels.gemv import GemvTiling

COPY_BANDWIDTH = 4.24e12  # bytes/s, the H200's measured copy ceiling (docs/latency.md)
ROWS = (1, 2, 4, 8, 16, 32)
COPIES = 24

Timer = Callable[[Callable[[], None]], float]  # fn -> median milliseconds of one fn()


def ouro_projections(config: OuroConfig) -> dict[str, tuple[int, int]]:
    """(N, K) of the fused projections of one layer; down's K is the intermediate size."""
    hidden, inner = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    qkv = q_size + 2 * config.num_key_value_heads * config.head_dim
    return {"qkv": (qkv, hidden), "o": (hidden, q_size), "gate_up": (2 * inner, hidden),
            "down": (hidden, inner)}  # fmt: skip


def tilings() -> list[GemvTiling]:
    """The default and a small grid around it (each one is a compile per projection)."""
    from loopserve.kernels.gemv import DEFAULT_TILING

    change = dataclasses.replace
    return [
        DEFAULT_TILING,
        change(DEFAULT_TILING, block_n=32),
        change(DEFAULT_TILING, block_n=128, block_k=64),
        change(DEFAULT_TILING, block_k=256, num_stages=3),
        change(DEFAULT_TILING, target_programs=528),
        change(DEFAULT_TILING, num_warps=8),
    ]


@dataclass(frozen=True, slots=True)
class Settings:
    device: torch.device
    timer: Timer
    projections: dict[str, tuple[int, int]]
    rows: tuple[int, ...] = ROWS
    copies: int = COPIES
    dtype: torch.dtype = torch.bfloat16


def bench_projection(name: str, m: int, settings: Settings, tiling_grid: list[GemvTiling]) -> dict:
    """cuBLAS and every tiling on `settings.copies` copies of one projection's weight, M rows."""
    from loopserve.kernels import fused_ops, gemv

    n, k = settings.projections[name]
    device, dtype = settings.device, settings.dtype
    weights = [torch.randn(n, k, device=device).to(dtype) / k**0.5 for _ in range(settings.copies)]
    silu = name == "down"
    x = torch.randn(m, 2 * k if silu else k, device=device).to(dtype)
    gate, up = x.split([k, k], dim=-1) if silu else (x, x)

    def per_call_us(call: Callable[[torch.Tensor], object]) -> float:
        def step() -> None:
            for weight in weights:
                call(weight)

        return 1000 * settings.timer(step) / len(weights)

    if silu:
        cublas = per_call_us(lambda w: F.linear(fused_ops.silu_mul(gate, up), w))
    else:
        cublas = per_call_us(lambda w: F.linear(x, w))
    element = torch.empty((), dtype=dtype).element_size()
    moved = (n * k + x.numel() + m * n) * element
    record: dict = {"projection": name, "n": n, "k": k, "m": m, "bytes": moved}
    record |= _figures("cublas", cublas, moved)
    record["triton"] = []
    for tiling in tiling_grid:
        entry = {"tiling": dataclasses.asdict(tiling), "split_k": tiling.split(n, k)[0]}
        try:
            if silu:
                us = per_call_us(functools.partial(_silu_linear, gate, up, tiling=tiling))
            else:
                us = per_call_us(functools.partial(gemv.linear, x, tiling=tiling))
            entry |= _figures("", us, moved)
        except Exception as error:  # one tiling failing must not hide the others
            entry["error"] = f"{type(error).__name__}: {error}"[:300]
        record["triton"].append(entry)
    timed = [entry for entry in record["triton"] if "us" in entry]
    if timed:
        best = min(timed, key=lambda entry: entry["us"])
        record["best_tiling"] = best["tiling"]
        record |= _figures("triton", best["us"], moved)
        record["winner"] = "triton" if best["us"] < cublas else "cublas"
    return record


def _silu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling
) -> torch.Tensor:
    from loopserve.kernels import gemv

    return gemv.silu_linear(gate, up, weight, tiling)


def _figures(prefix: str, us: float, moved: int) -> dict[str, float]:
    key = f"{prefix}_" if prefix else ""
    tb_per_s = moved / us / 1e6
    return {
        f"{key}us": us,
        f"{key}tb_s": tb_per_s,
        f"{key}fraction": tb_per_s * 1e12 / COPY_BANDWIDTH,
    }


def run(settings: Settings, emit: Callable[[dict], None]) -> list[dict]:
    from loopserve.bench.provenance import describe

    where = describe(settings.device)
    base = {"bench": "gemv", "git": where.git_sha, "device": where.device}
    base["dtype"] = str(settings.dtype).removeprefix("torch.")
    grid, records = tilings(), []
    for name in settings.projections:
        for m in settings.rows:
            record = {**base, **bench_projection(name, m, settings, grid)}
            records.append(record)
            emit(record)
            if settings.device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def markdown(records: list[dict]) -> str:
    """One line per (projection, M): cuBLAS, the default tiling and the best one, µs (TB/s)."""
    lines = [
        "| projection | M | MB | cuBLAS µs (TB/s) | default µs (TB/s) | best µs (TB/s, of 4.24) "
        "| best tiling (n, k, programs, warps, stages) | winner |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        default = r["triton"][0]
        best = r.get("best_tiling")
        tiling = "error" if best is None else ", ".join(str(value) for value in best.values())
        best_cell = (
            "error" if best is None else f"{_cell(r, 'triton_')}, {r['triton_fraction']:.0%}"
        )
        lines.append(
            f"| {r['projection']} | {r['m']} | {r['bytes'] / 1e6:.1f} | {_cell(r, 'cublas_')} | "
            f"{_cell(default, '') if 'us' in default else 'error'} | {best_cell} | {tiling} | "
            f"{r.get('winner', 'cublas')} |"
        )
    return "\n".join(lines) + "\n"


def _cell(record: dict, prefix: str) -> str:
    return f"{record[prefix + 'us']:.1f} ({record[prefix + 'tb_s']:.2f})"


def cuda_timer(fn: Callable[[], None]) -> float:
    from loopserve.bench.attention_table import replay_ms

    return replay_ms(fn)


def wall_timer(fn: Callable[[], None]) -> float:
    """CPU stand-in for `cuda_timer` (the smoke run): median wall time of three calls."""
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


SMOKE_PROJECTIONS = {"qkv": (48, 40), "down": (24, 72)}


def smoke_settings() -> Settings:
    return Settings(torch.device("cpu"), wall_timer, SMOKE_PROJECTIONS, rows=(1, 3), copies=2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=parse_list, default=list(ROWS))
    parser.add_argument("--projections", default="qkv,o,gate_up,down")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the CPU interpreter")
    parser.add_argument("--out", help="append the JSON lines to this file too")
    parser.add_argument("--markdown", help="write the table to this file too")
    args = parser.parse_args(argv)
    known = ouro_projections(OuroConfig())
    unknown = [name for name in args.projections.split(",") if name not in known]
    if unknown:
        parser.error(f"unknown projections {unknown}; known: {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        settings = smoke_settings()
    elif torch.cuda.is_available():
        projections = ouro_projections(OuroConfig())
        chosen = {name: projections[name] for name in args.projections.split(",")}
        device = torch.device("cuda", torch.cuda.current_device())
        settings = Settings(device, cuda_timer, chosen, rows=tuple(args.rows))
    else:
        print("loopserve.bench.gemv needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(line + "\n")

    records = run(settings, emit)
    table = markdown(records)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write(table)
    return 1 if any("winner" not in record for record in records) else 0


if __name__ == "__main__":
    if "--smoke" in sys.argv:  # the interpreter must be chosen before the kernels are defined
        os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(main())
