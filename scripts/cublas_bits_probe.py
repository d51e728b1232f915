"""Does our Triton matmul give cuBLAS's bits? (CUDA GPU; tenth session's question.)

`python scripts/cublas_bits_probe.py OUT.jsonl`, from the repository root. For each weight matmul
of an Ouro-1.4B layer (bf16, `F.linear` as the model runs it) and a range of row counts M, it
compares `kernels.matmul.linear` under several tilings with `F.linear` element by element and
writes one JSON line per (shape, M, tiling): the fraction of equal outputs and the largest
difference in bf16 units in the last place; then, per (shape, M), the names of the kernels
cuBLAS launched (a split-K reduce shows up as its own kernel).

Why it matters: if our kernel's bits equal cuBLAS's, a fused kernel of ours (a norm in its
prologue, SiLU·up in its epilogue) can serve the small row counts and cuBLAS the large ones
without a row getting other bits alone than in a batch; if not, any switch between them by row
count breaks that property (docs/latency.md, "Batch invariance at full size").
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from loopserve.kernels.matmul import Tiling, linear

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
ROW_COUNTS = (1, 4, 16, 32, 64, 128, 512)
TILINGS = {
    "16x16x256": Tiling(16, 16, 256, 4, 4),
    "16x32x128": Tiling(16, 32, 128, 4, 3),
    "16x64x64": Tiling(16, 64, 64, 4, 3),
    "64x64x64": Tiling(64, 64, 64, 4, 3),
    "128x64x64": Tiling(128, 64, 64, 8, 3),
    "64x128x16": Tiling(64, 128, 16, 4, 3),
}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 steps between equal-signed values (sign flips count as large)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return int((ia - ib).abs().max())


def cublas_kernels(x: torch.Tensor, weight: torch.Tensor) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    F.linear(x, weight)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        F.linear(x, weight)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type.name == "CUDA"]


def main(path: str) -> None:
    torch.manual_seed(0)
    with open(path, "a") as out:
        for name, (n, k) in SHAPES.items():
            weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            x_all = torch.randn(ROW_COUNTS[-1], k, device="cuda", dtype=torch.bfloat16)
            for m in ROW_COUNTS:
                x = x_all[:m]
                reference = F.linear(x, weight)
                kernels = cublas_kernels(x, weight)
                print(f"{name} M={m} cuBLAS: {kernels}", flush=True)
                out.write(json.dumps({"shape": name, "m": m, "cublas": kernels}) + "\n")
                for label, tiling in TILINGS.items():
                    ours = linear(x, weight, tiling)
                    equal = float((ours == reference).float().mean())
                    row = {"shape": name, "m": m, "tiling": label, "equal": equal}
                    row["max_ulps"] = ulps(ours, reference)
                    print(json.dumps(row), flush=True)
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
