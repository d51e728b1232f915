"""Triton matmuls shaped for decode: y[M, N] = x[M, K] @ W[N, K]^T for a few rows (M <= 16).

Owns: `GemvTiling` (the tile shape and the split of K, fixed per weight shape), the kernel, and
`linear` / `silu_linear` (the latter computes silu(gate) * up on the fly: the down projection
without a separate SiLU·up launch). Must not: sync with the host or allocate anything a CUDA
graph could not replay (the per-call fp32 workspace comes from torch's caching allocator; the
arrival counters are allocated once per device and left at zero by the kernel itself).

Memory-bound design: the weight is streamed once. A program owns `block_n` output columns (rows
of W, read along K, coalesced), one slice of K and a block of 16 input rows (`tl.dot` of the W
tile by the transposed x tile, fp32 accumulation). K is cut into `split_k` slices from the shape
alone so that even N = 2048 has enough programs to fill the GPU; each slice's partial goes to an
fp32 workspace and the last program of a column block to arrive (an atomic counter, as in
kernels/paged_decode.py) adds the slices in slice order and stores the result in the input dtype.
Programs of the same columns and slice but other row blocks are adjacent in the grid, so a W
tile read for one row block is still in L2 for the next (M > 16).

Batch invariance. The row block is always 16 rows (padded), the split and the tile loop depend
only on (N, K, tiling), and the slices are added in one fixed order whichever program does it, so
a row's bits depend neither on M nor on the other rows. The silu variant rounds like
kernels/fused_ops.py (`_silu_mul_kernel`): silu in fp32 rounded to the dtype, times up rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program; fixed (not from M) so that a row's arithmetic never changes
MAX_COUNTERS = 1 << 16  # arrival counters per device: column blocks x row blocks of one launch


@dataclass(frozen=True, slots=True)
class GemvTiling:
    """Tile shape and split of K: may change a row's bits, so fixed per weight shape, never
    chosen from M.

    block_n: output columns (rows of W) per program. block_k: K per tile (a power of two >= 16).
    target_programs: the split of K is the smallest that gives column blocks x slices >= this
        (2 programs per SM on the 132 SMs of an H200), at most one slice per K tile.
    num_warps, num_stages: warps per program; tiles in flight (software pipelining of the loads).
    """

    block_n: int = 64
    block_k: int = 128
    target_programs: int = 264
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self) -> None:
        powers = (self.block_n, self.block_k, self.num_warps)
        if any(value < 1 or value & (value - 1) for value in powers):
            raise ValueError(f"{self}: block_n, block_k and num_warps must be powers of two")
        if self.block_n < 16 or self.block_k < 16 or self.num_stages < 1:
            raise ValueError(f"{self}: tl.dot needs block_n, block_k >= 16; stages >= 1")

    def split(self, n: int, k: int) -> tuple[int, int]:
        """(slices of K, K per slice: a multiple of block_k) for an [N, K] weight."""
        k_tiles = triton.cdiv(k, self.block_k)
        wanted = min(k_tiles, triton.cdiv(self.target_programs, triton.cdiv(n, self.block_n)))
        chunk = triton.cdiv(k_tiles, max(1, wanted)) * self.block_k
        return triton.cdiv(k, chunk), chunk


DEFAULT_TILING = GemvTiling()  # provisional: to be set from `python -m loopserve.bench.gemv`


@triton.jit
def _input_tile(x_ptr, up_ptr, rows, cols, stride_x, stride_up, mask, SILU: tl.constexpr):
    """The transposed input tile [BLOCK_K, BLOCK_M] (rows, cols: [1, BLOCK_M], [BLOCK_K, 1]);
    with SILU, silu(gate) * up rounded as kernels/fused_ops.py rounds it."""
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0)
    if SILU:
        dtype = x.dtype
        gate = x.to(tl.float32)
        up = tl.load(up_ptr + rows * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        x = (activated * up).to(dtype)
    return x


@triton.jit(do_not_specialize=["m"])
def _gemv_kernel(
    x_ptr,  # [M, K] (SILU: the gate [M, K])
    up_ptr,  # SILU: the up [M, K]; else unused
    w_ptr,  # [N, K], K contiguous
    out_ptr,  # [M, N]
    partial_ptr,  # [SPLIT, M, N] fp32 (SPLIT > 1)
    counter_ptr,  # [row blocks x column blocks] int32, 0 between launches (SPLIT > 1)
    m,
    n,
    k,
    stride_x,
    stride_up,
    stride_w,
    stride_out,
    CHUNK: tl.constexpr,  # K per slice, a multiple of BLOCK_K
    SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,  # BLOCK_M
    NUM_STAGES: tl.constexpr,
    SILU: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # dots in fp32 (only under the CPU interpreter)
):
    row_block = tl.program_id(0)
    column_block = tl.program_id(1)
    piece = tl.program_id(2)
    rows = row_block * ROWS + tl.arange(0, ROWS)  # [ROWS]
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < m
    column_ok = columns < n
    offsets = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + columns.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    x_rows = rows.to(tl.int64)[None, :]  # [1, ROWS]
    start = piece * CHUNK
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in tl.range(start, tl.minimum(start + CHUNK, k), BLOCK_K, num_stages=NUM_STAGES):
        cols = k0 + offsets
        col_ok = cols < k
        w = tl.load(w_rows + cols[None, :], mask=column_ok[:, None] & col_ok[None, :], other=0.0)
        x = _input_tile(
            x_ptr, up_ptr, x_rows, cols[:, None], stride_x, stride_up,
            row_ok[None, :] & col_ok[:, None], SILU,
        )  # fmt: skip
        if UPCAST:  # the CPU interpreter multiplies bf16 bit patterns as integers; fp32 is exact
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, x, acc, input_precision=INPUT_PRECISION)
    out_offsets = rows.to(tl.int64)[None, :] * stride_out + columns[:, None]  # [BLOCK_N, ROWS]
    out_mask = column_ok[:, None] & row_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile = rows.to(tl.int64)[None, :] * n + columns[:, None]  # in one slice's [M, N]
        tl.store(partial_ptr + piece * m * n + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stores precede the release below
        counter = counter_ptr + row_block * tl.num_programs(1) + column_block
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last slice of these columns to arrive adds them all
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            total = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            for other in range(SPLIT):  # slice order, whichever program arrives last
                part = partial_ptr + other * m * n + tile
                total += tl.load(part, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offsets, total.to(out_ptr.dtype.element_ty), mask=out_mask)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The device's arrival counters, zero at rest; allocated on first use (a warm-up call, not
    under graph capture). Launches on one stream run one after another, so they share them."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters


def linear(
    x: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling = DEFAULT_TILING
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype (fp32 accumulation)."""
    return _launch(x, None, weight, tiling)


def silu_linear(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, tiling: GemvTiling = DEFAULT_TILING
) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T for gate, up [M, I] (views of the gate_up output, say) and
    weight [N, I]: the SiLU·up rounded as `fused_ops.silu_mul` rounds it, in the same launch."""
    if up.shape != gate.shape or up.dtype != gate.dtype or up.stride(-1) != 1:
        raise ValueError("gate and up must have one shape and dtype, contiguous last dim")
    return _launch(gate, up, weight, tiling)


def _launch(
    x: torch.Tensor, up: torch.Tensor | None, weight: torch.Tensor, tiling: GemvTiling
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} vs weight {tuple(weight.shape)} {weight.dtype}"
        )
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    split, chunk = tiling.split(n, k)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, tiling.block_n), split)
    if split > 1 and grid[0] * grid[1] > MAX_COUNTERS:
        raise ValueError(f"{grid[0] * grid[1]} column x row blocks exceed {MAX_COUNTERS} counters")
    partials = torch.empty(
        (split, m, n) if split > 1 else (1,), dtype=torch.float32, device=x.device
    )
    counters = _counters(x.device) if split > 1 else partials
    _gemv_kernel[grid](
        x, up if up is not None else x, weight, out, partials, counters,
        m, n, k, x.stride(0), (up if up is not None else x).stride(0), weight.stride(0),
        out.stride(0),
        CHUNK=chunk, SPLIT=split, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, ROWS=BLOCK_M,
        NUM_STAGES=tiling.num_stages, SILU=up is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=x.device.type == "cpu",
        num_warps=tiling.num_warps,
    )  # fmt: skip
    return out
