"""How cuBLAS splits the down projection's K, and at which row counts (CUDA GPU; tenth session).

`python scripts/splitk_probe.py OUT.jsonl`, from the repository root. Ouro-1.4B's down projection
(K = 5,632, N = 2,048, bf16) is the one weight matmul whose cuBLAS bits change with the row count
(docs/latency.md, "Batch invariance at full size"): up to 128 rows cuBLAS runs a split-K kernel
and a `splitKreduce_kernel`. This probe writes one JSON line per finding:
1. `classes`: for every row count M from 1 to 2,048, whether cuBLAS's row 0 equals
   `kernels.matmul.linear`'s (which never splits K), as runs of M with the same answer;
2. `split`: for M = 1 and 64, candidate splits of K into S slices (S = 2..24; 64-wide K tiles
   dealt out evenly, the first slices taking the remainder, or as ceil-sized slices), each slice
   reduced by the same tensor-core chain as `linear` into an fp32 partial, the partials summed in
   slice order (or in reverse) and rounded to bf16: the fraction of outputs equal to cuBLAS's.
A candidate at 1.0 would let one Triton launch (partials folded by the last program to arrive)
replace cuBLAS's two with the same bits.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loopserve.kernels.matmul import linear

HIDDEN, INTER = 2048, 5632
TILE_K = 64


@triton.jit
def _partial_kernel(a_ptr, w_ptr, out_ptr, M, N, k_start, k_end, K: tl.constexpr):
    """fp32 x[:, k_start:k_end] W[:, k_start:k_end]^T, unrounded; one 16 x 64 block a program."""
    rows = tl.program_id(1) * 16 + tl.arange(0, 16)
    cols = tl.program_id(0) * 64 + tl.arange(0, 64)
    acc = tl.zeros((16, 64), dtype=tl.float32)
    for start in range(k_start, k_end, 64):
        depth = start + tl.arange(0, 64)
        a = tl.load(a_ptr + rows[:, None] * K + depth[None, :], mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * K + depth[:, None])
        acc = tl.dot(a, w, acc)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=rows[:, None] < M)


def _partial(x: torch.Tensor, weight: torch.Tensor, k_start: int, k_end: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[0], device=x.device, dtype=torch.float32)
    grid = (weight.shape[0] // 64, triton.cdiv(x.shape[0], 16))
    _partial_kernel[grid](x, weight, out, x.shape[0], weight.shape[0], k_start, k_end,
                          K=weight.shape[1])  # fmt: skip
    return out


def _slices(splits: int, even: bool) -> list[tuple[int, int]]:
    tiles = INTER // TILE_K
    if even:
        base, extra = divmod(tiles, splits)
        counts = [base + (1 if s < extra else 0) for s in range(splits)]
    else:
        size = -(-tiles // splits)
        counts = [min(size, tiles - s * size) for s in range(splits) if s * size < tiles]
    bounds, start = [], 0
    for count in counts:
        bounds.append((start * TILE_K, (start + count) * TILE_K))
        start += count
    return bounds


def main(path: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(2048, INTER, device="cuda", dtype=torch.bfloat16)
    ours = linear(x, weight)  # row r of any M is this row: linear's bits never depend on M
    runs: list[list[int]] = []
    for m in range(1, 2049):
        same = bool(torch.equal(F.linear(x[:m], weight)[0], ours[0]))
        if runs and runs[-1][2] == same and runs[-1][1] == m - 1:
            runs[-1][1] = m
        else:
            runs.append([m, m, same])
    with open(path, "a") as sink:
        line = {"classes": [{"from": a, "to": b, "equals_no_split": s} for a, b, s in runs]}
        print(json.dumps(line), flush=True)
        sink.write(json.dumps(line) + "\n")
        for m in (1, 64):
            cublas = F.linear(x[:m], weight)
            for splits in range(2, 25):
                for even in (True, False):
                    bounds = _slices(splits, even)
                    partials = [_partial(x[:m].contiguous(), weight, a, b) for a, b in bounds]
                    for order in ("forward", "reverse"):
                        seq = partials if order == "forward" else partials[::-1]
                        total = seq[0].clone()
                        for p in seq[1:]:
                            total += p
                        got = total.to(torch.bfloat16)
                        row = {"split": splits, "even": even, "order": order, "m": m}
                        row["equal"] = float((got == cublas).float().mean())
                        sink.write(json.dumps(row) + "\n")
                        if row["equal"] > 0.999:
                            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
