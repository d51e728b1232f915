"""What the batch-invariant down projection and exit gate cost against cuBLAS (GPU).

`python -m benchmarks.invariant_matmul [--rows 1,8,...] [--out FILE]`: for Ouro-1.4B's down
projection (`kernels.matmul.linear` against cuBLAS, each after `fused_ops.silu_mul`, the same
launch on both sides and in the timing) and exit gate (`kernels.matmul.gate_logit`, the bf16
hidden state cast in the kernel, against `.float()` then cuBLAS) at each row count: µs per call
by CUDA-graph replay (`graph_replay.replay_ms`, the median) over enough weight copies to
defeat the 50 MB L2, the bytes each must move (weights, activations in and out) and its FLOPs,
as TB/s and TFLOP/s and as fractions of the ceilings `bench.calibration` measures on the device.
Prints one JSON line per (shape, rows).
Must not: check correctness (tests/kernels/test_matmul.py does).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.graph_replay import replay_ms
from benchmarks.jsonl import emit
from loopserve.bench.calibration import measure_ceilings
from loopserve.kernels import fused_ops
from loopserve.kernels.matmul import gate_logit, linear

HIDDEN, INTER = 2048, 5632  # Ouro-1.4B
L2_BYTES = 50 * 2**20


def _replay_us(work: Callable[[], object], copies: int) -> float:
    """µs per call: the median replay of a CUDA graph of `copies` calls (each over its own weight
    copy), divided by `copies`."""
    return replay_ms(work) * 1e3 / copies


def _down(rows: int, copies: int) -> dict[str, float]:
    weights = [
        torch.randn(HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) for _ in range(copies)
    ]
    gate = torch.randn(rows, INTER, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(gate)
    return {
        "invariant_us": _replay_us(
            lambda: [linear(fused_ops.silu_mul(gate, up), w) for w in weights], copies
        ),
        "cublas_us": _replay_us(
            lambda: [F.linear(fused_ops.silu_mul(gate, up), w) for w in weights], copies
        ),
        "bytes": 2 * (HIDDEN * INTER + 2 * rows * INTER + rows * HIDDEN),
        "flops": 2 * rows * HIDDEN * INTER,
    }


def _gate(rows: int, copies: int) -> dict[str, float]:
    weights = [torch.randn(1, HIDDEN, device="cuda") for _ in range(copies)]
    bias = torch.zeros(1, device="cuda")
    hidden = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    return {
        "invariant_us": _replay_us(lambda: [gate_logit(hidden, w, bias) for w in weights], copies),
        "cublas_us": _replay_us(
            lambda: [F.linear(hidden.float(), w, bias) for w in weights], copies
        ),
        "bytes": 4 * HIDDEN + 2 * rows * HIDDEN + 4 * rows,
        "flops": 2 * rows * HIDDEN,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", default="1,8,32,64,96,128,256,512,2048")
    parser.add_argument("--out", type=Path, help="also append the JSON lines here")
    args = parser.parse_args(argv)
    ceilings = measure_ceilings(torch.device("cuda"), torch.bfloat16)
    for rows in (int(r) for r in args.rows.split(",")):
        for name, measure in (("down", _down), ("gate", _gate)):
            weight_bytes = 2 * HIDDEN * INTER if name == "down" else 4 * HIDDEN
            figures = measure(rows, copies=max(1, min(24, 2 * L2_BYTES // weight_bytes + 1)))
            record: dict[str, object] = {"shape": name, "rows": rows}
            for side in ("invariant", "cublas"):
                seconds = figures[f"{side}_us"] * 1e-6
                record[f"{side}_us"] = round(figures[f"{side}_us"], 2)
                record[f"{side}_tb_s"] = round(figures["bytes"] / seconds / 1e12, 3)
                record[f"{side}_tflop_s"] = round(figures["flops"] / seconds / 1e12, 1)
                record[f"{side}_of_copy"] = round(
                    figures["bytes"] / seconds / ceilings.copy_bytes_per_s, 3
                )
                record[f"{side}_of_matmul"] = round(
                    figures["flops"] / seconds / ceilings.matmul_flops_per_s, 3
                )
            record["invariant_over_cublas"] = round(
                figures["invariant_us"] / figures["cublas_us"], 3
            )
            emit(record, args.out)


if __name__ == "__main__":
    main()
