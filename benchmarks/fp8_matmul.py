"""What fp8 weights buy a layer's projections, and which tiling does it (GPU).

`python -m benchmarks.fp8_matmul [--rows 1,8,...] [--shapes qkv,o,gate_up,down] [--gemv]
[--out FILE]`: for Ouro-1.4B's four projections (the gate/up one with SiLU·up as its epilogue,
as the engine runs it) at each row count, µs per call by CUDA-graph replay
(`graph_replay.replay_ms`, the median) over enough weight copies to defeat the 50 MB L2, of:
cuBLAS on the bf16 weight (and `silu_mul` after it for gate/up); the rows quantized
(`kernels.e4m3.quantize_rows`) and multiplied by the fp8 weight in `kernels.matmul.linear` under
its default tiling and under each candidate tiling, and in cuBLAS's fp8 matmul
(`models.quant.scaled_mm`, records with `"kernel": "scaled_mm"`), each as the engine runs it
(quantization included, unless `--made-rows`: the rows come quantized, as `add_norm` hands them
to the qkv and gate/up projections); `linear` also under `FP8_DOT` (fp8 by fp8 on the tensor
cores); with `--gemv`, also `kernels.gemv.fp8_gemv` (which quantizes in the kernel) under its
default and each of `GEMV_CANDIDATES` at up to `GEMV_MAX_ROWS` rows (`"kernel": "gemv"`). A
candidate that fails to compile is a record with its `"error"`. Each figure
comes with the bytes it must move (weights, scales, activations in and out) as a fraction of the
copy bandwidth `bench.calibration` measures.
Prints one JSON line per (shape, rows, tiling); the best candidate per (shape, rows) last.
Must not: check correctness (tests/kernels/test_fp8_matmul.py does).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.graph_replay import replay_ms
from benchmarks.jsonl import emit
from loopserve.bench.calibration import measure_ceilings
from loopserve.kernels import fused_ops
from loopserve.kernels.e4m3 import quantize_rows
from loopserve.kernels.gemv import GemvTiling, fp8_gemv, gemv_tiling
from loopserve.kernels.matmul import Tiling, fp8_dots, fp8_tiling, linear
from loopserve.models.quant import quantize_weight, scaled_mm

HIDDEN, INTER = 2048, 5632  # Ouro-1.4B (16 heads of 128: q, k and v are 2,048 wide each)
SHAPES = {  # name -> (W's rows N, K)
    "qkv": (3 * HIDDEN, HIDDEN),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
}
L2_BYTES = 50 * 2**20
FEW_ROWS = [  # candidates up to 16 rows: thin column blocks, deep K slices
    Tiling(16, 16, 256, 4, 4),
    Tiling(16, 16, 512, 4, 3),
    Tiling(16, 32, 256, 4, 3),
    Tiling(16, 32, 512, 4, 3),
    Tiling(16, 64, 256, 4, 3),
    Tiling(16, 16, 1024, 4, 2),
]
MID_ROWS = [  # 17 to 128 rows
    Tiling(16, 32, 128, 4, 3),
    Tiling(16, 32, 256, 4, 3),
    Tiling(32, 32, 256, 4, 3),
    Tiling(16, 64, 256, 4, 3),
    Tiling(32, 64, 128, 4, 3),
    Tiling(64, 64, 128, 4, 3),
]
MANY_ROWS = [  # prompt chunks
    Tiling(128, 64, 64, 8, 3),
    Tiling(128, 128, 64, 8, 3),
    Tiling(128, 128, 128, 8, 3),
    Tiling(64, 128, 64, 4, 3),
    Tiling(128, 64, 128, 8, 3),
]

# fp8 rows times the fp8 weight as fp8 on Hopper's tensor cores (`Tiling.fp8_dot`), tried at
# every row count: no widening to bf16 in registers; the fp8 sums promoted to fp32 every 32 of K
# (the engine's) or every 128 (cuBLAS's default; less accurate, faster with 64-row tiles).
FP8_DOT = [
    Tiling(m, n, k, warps, 3, fp8_dot=True, fp8_sums=sums)
    for m, n, k, warps in [
        (16, 32, 256, 4),
        (16, 64, 256, 4),
        (32, 64, 128, 4),
        (64, 64, 128, 4),
        (64, 64, 256, 4),
        (64, 128, 128, 4),
        (128, 64, 128, 8),
        (128, 128, 128, 8),
    ]
    for sums in (32, 128)
]

GEMV_MAX_ROWS = 16
GEMV_CANDIDATES = [  # (columns per program, K slice, warps): bytes in flight against programs
    GemvTiling(2, 1024, 1),
    GemvTiling(4, 512, 1),
    GemvTiling(4, 512, 2),
    GemvTiling(4, 1024, 2),
    GemvTiling(4, 1024, 4),
    GemvTiling(8, 256, 2),
    GemvTiling(8, 512, 2),
    GemvTiling(8, 512, 4),
    GemvTiling(8, 1024, 4),
    GemvTiling(16, 256, 4),
    GemvTiling(16, 512, 4),
    GemvTiling(16, 512, 8),
    # one K slice (K up to 2,048, or 8,192 for down's 5,632): the weight's load goes out before
    # the row's scale is found (kernels/gemv.py)
    GemvTiling(2, 2048, 2),
    GemvTiling(4, 2048, 4),
    GemvTiling(8, 2048, 4),
    GemvTiling(4, 8192, 8),
]


def candidates(rows: int) -> list[Tiling]:
    return (FEW_ROWS if rows <= 16 else MID_ROWS if rows <= 128 else MANY_ROWS) + FP8_DOT


def _replay_us(work: Callable[[], object], copies: int) -> float:
    return replay_ms(work) * 1e3 / copies


def measure(
    shape: str, rows: int, ceiling_bytes_per_s: float, gemv: bool = False, made: bool = False
) -> list[dict[str, object]]:
    columns, depth = SHAPES[shape]
    swiglu = shape == "gate_up"
    copies = max(1, min(24, 2 * L2_BYTES // (columns * depth) + 1))
    weights = [
        0.02 * torch.randn(columns, depth, device="cuda", dtype=torch.bfloat16)
        for _ in range(copies)
    ]
    quantized = [quantize_weight(weight) for weight in weights]
    x = torch.randn(rows, depth, device="cuda", dtype=torch.bfloat16)
    out_columns = columns // 2 if swiglu else columns
    activations = 2 * rows * (depth + out_columns)
    bf16_bytes = 2 * columns * depth + activations
    fp8_bytes = columns * depth + 4 * columns + 4 * rows + activations

    def cublas() -> object:
        if swiglu:
            return [fused_ops.silu_mul(*F.linear(x, w).chunk(2, dim=-1)) for w in weights]
        return [F.linear(x, w) for w in weights]

    made_rows = quantize_rows(x)

    def rows8() -> tuple[torch.Tensor, torch.Tensor]:
        return made_rows if made else quantize_rows(x)

    def cublas_fp8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        out = scaled_mm(*rows8(), w8, scale)
        return fused_ops.silu_mul(*out.chunk(2, dim=-1)) if swiglu else out

    def triton_fp8(tiling: Tiling, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x8, x_scale = rows8()
        return linear(x8, w8, tiling, swiglu=swiglu, scale=scale, x_scale=x_scale, dtype=x.dtype)

    def gemv_fp8(tiling: GemvTiling, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if not made:
            return fp8_gemv(x, w8, scale, swiglu=swiglu, tiling=tiling)
        x8, x_scale = made_rows
        return fp8_gemv(x8, w8, scale, swiglu=swiglu, tiling=tiling, x_scale=x_scale,
                        dtype=x.dtype)  # fmt: skip

    def fp8(tiling: Tiling | GemvTiling | None) -> Callable[[], object]:
        if tiling is None:
            return lambda: [cublas_fp8(w8, scale) for w8, scale in quantized]
        if isinstance(tiling, GemvTiling):
            return lambda: [gemv_fp8(tiling, w8, scale) for w8, scale in quantized]
        return lambda: [triton_fp8(tiling, w8, scale) for w8, scale in quantized]

    cublas_us = _replay_us(cublas, copies)
    base = {"shape": shape, "rows": rows, "N": columns, "K": depth, "bf16_cublas_us": cublas_us}
    base["made_rows"] = made
    base["bf16_of_copy"] = bf16_bytes / (cublas_us * 1e-6) / ceiling_bytes_per_s
    default = fp8_tiling(rows, invariant=False, dots=fp8_dots(x.device))
    tried: list[tuple[Tiling | GemvTiling | None, bool]] = [(default, True), (None, False)]
    tried += [(t, False) for t in candidates(rows) if t != default]
    if gemv and rows <= GEMV_MAX_ROWS:
        gemv_default = gemv_tiling(columns, depth)
        tried += [(gemv_default, True)]
        tried += [(t, False) for t in GEMV_CANDIDATES if t != gemv_default]
    records, timed = [], []
    for tiling, is_default in tried:
        record = base | {
            "kernel": _kernel(tiling),
            "tiling": None if tiling is None else list(dataclasses.astuple(tiling)),
            "default": is_default,
        }
        try:
            us = _replay_us(fp8(tiling), copies)
        except Exception as error:  # a candidate the compiler refuses (e.g. fp8 dots)
            records.append(record | {"error": f"{type(error).__name__}: {error}"[:300]})
            continue
        record |= {
            "fp8_us": us,
            "fp8_of_copy": fp8_bytes / (us * 1e-6) / ceiling_bytes_per_s,
            "fp8_over_bf16_cublas": us / cublas_us,
        }
        records.append(record)
        timed.append(record)
    if not timed:
        return records
    best = min(timed, key=lambda record: float(record["fp8_us"]))  # type: ignore[arg-type]
    return [*records, best | {"best": True}]


def _kernel(tiling: Tiling | GemvTiling | None) -> str:
    return "scaled_mm" if tiling is None else "gemv" if isinstance(tiling, GemvTiling) else "linear"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gemv", action="store_true", help="also time kernels.gemv.fp8_gemv")
    parser.add_argument(
        "--made-rows", action="store_true", help="rows come quantized (as add_norm makes them)"
    )
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
    args = parser.parse_args(argv)
    ceilings = measure_ceilings(torch.device("cuda"), torch.bfloat16)
    for shape in args.shapes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for record in measure(shape, rows, ceilings.copy_bytes_per_s, args.gemv,
                                  args.made_rows):  # fmt: skip
                rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}
                emit(rounded, args.out)


if __name__ == "__main__":
    main()
