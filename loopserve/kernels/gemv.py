"""FP8-weight GEMV: a few rows of x times an e4m3 W, read at memory speed (decode at low
concurrency, where a step is the weights' bytes).

Owns: `fp8_gemv` (the `models.quant` rule — x quantized per row, fp32 sums of its e4m3 values times
W's, times the row's scale and W's, rounded to x's dtype (the dtype fp8 rows came from) —
optionally SiLU·up of a fused gate/up projection's halves and a row mask, like
`kernels.matmul.linear`) and its tiling per weight shape (`gemv_tiling`). Must not: use the tensor
cores, or let a row's sum depend on the other rows or on M.

How. One program per (row, block of BLOCK_N columns); rows vary fastest in the grid, so the
programs that read one weight block run together and the weight comes from DRAM once (the others
hit the L2). A program first finds its row's largest |x| (one pass over the row, which the L2
holds), which gives the row's activation scale (`kernels.e4m3.row_scales`), so x is quantized in
registers with no launch of its own; rows that come quantized (fp8 with their scales, from the
kernel that made them: `kernels.fused_ops.add_norm`) skip that pass. The first weight slice is
loaded before any of that: launched as a programmatic dependent (`pdl`, `kernels.pdl`), the
program waits for the kernel that makes x only after that load went out. It then walks K in BLOCK_K
slices, widening each [BLOCK_N, BLOCK_K] fp8 tile to fp32 and adding the quantized x times it
into an fp32 [BLOCK_N, BLOCK_K] accumulator (no reduction inside the loop), then folds the
BLOCK_K lanes in `tl.sum`'s fixed tree. A row's bits therefore depend on the tiling only, which
`gemv_tiling` picks from W's shape, never from M: a row has the same bits at every row count this
kernel runs (tests/kernels/test_gemv.py). They are not `kernels.matmul.linear`'s bits (the tensor
cores add 16-wide slices in their own order), so the
engine runs this kernel only where it does not promise batch invariance
(`models.ops.TritonOps.GEMV_ROWS`; docs/quantization.md, "Where it runs").

Why not `kernels.matmul.linear` at one or two rows: its smallest tile is 16 rows of MMA. With
fp8 dots (fp8 by fp8 on the tensor cores) it took 40.8 and 40.4 µs over Ouro-1.4B's four
projections at one and two rows on an H100, against this kernel's 32.1 and 38.5 (rows that come
quantized); with the weight widened to bf16 it was no faster than cuBLAS on twice the bytes
(docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loopserve.kernels.e4m3 import e4m3_value, row_scales, triton_dtype
from loopserve.kernels.fused_ops import silu_times
from loopserve.kernels.pdl import launch_dependents, launch_options, wait_for_inputs
from loopserve.kv.storage import FP8


@triton.jit
def _depth(K, start, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The columns start : start + BLOCK_K and the mask of those inside K."""
    depth = start + tl.arange(0, BLOCK_K)
    return depth, depth < K if not EVEN_K else tl.full((BLOCK_K,), True, tl.int1)


@triton.jit
def _x_slice(x_row, K, start, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[start : start + BLOCK_K] in fp32 (0 past K)."""
    depth, in_depth = _depth(K, start, EVEN_K, BLOCK_K)
    return tl.load(x_row + depth, mask=in_depth, other=0.0).to(tl.float32)


@triton.jit
def _w_slice(w_rows, up_offset, in_cols, K, start, SWIGLU: tl.constexpr, EVEN_K: tl.constexpr,
             BLOCK_K: tl.constexpr):  # fmt: skip
    """W's [BLOCK_N, BLOCK_K] fp8 tile at column `start` (and W_up's, or W's again)."""
    depth, in_depth = _depth(K, start, EVEN_K, BLOCK_K)
    w_mask = in_cols[:, None] & in_depth[None, :]
    w = tl.load(w_rows + depth[None, :], mask=w_mask, other=0.0)
    w_up = w
    if SWIGLU:
        w_up = tl.load(w_rows + up_offset + depth[None, :], mask=w_mask, other=0.0)
    return w, w_up


@triton.jit
def _slice(
    x_row, inverse, w, w_up, K, start, acc, acc_up,
    SWIGLU: tl.constexpr, QUANTIZED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """acc (and acc_up) + x[start : start + BLOCK_K], quantized with the row's `inverse` scale
    (unless the row is `QUANTIZED` already), times W's (and W_up's) [BLOCK_N, BLOCK_K] slice
    `w` (`w_up`) loaded from there."""
    x = _x_slice(x_row, K, start, EVEN_K, BLOCK_K)
    if not QUANTIZED:
        x = e4m3_value(x, inverse)
    acc += w.to(tl.float32) * x[None, :]
    if SWIGLU:
        acc_up += w_up.to(tl.float32) * x[None, :]
    return acc, acc_up


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, x_scale_ptr, out_ptr, want_ptr, N, K, stride_x, stride_w, stride_out,
    QUANTIZED: tl.constexpr,  # x: fp8 rows with their scales at x_scale_ptr (no amax pass)
    DTYPE: tl.constexpr,  # what the sums round to: x's dtype, or the one fp8 rows came from
    MASKED: tl.constexpr,  # want_ptr: which rows to compute; the others get zeros
    SWIGLU: tl.constexpr,  # W = [W_gate; W_up], N = W's rows / 2: out = silu(x W_gate^T) * x W_up^T
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    UNROLL: tl.constexpr,  # 0, or K // BLOCK_K rounded up: the K loop unrolled (K is constant)
    PDL: tl.constexpr,  # launched as a programmatic dependent (`kernels.pdl`)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    out = out_ptr + row * stride_out + cols
    launch_dependents(PDL)
    if MASKED:  # a constexpr guard: no load is compiled without a mask
        wait_for_inputs(PDL)  # the mask was written by an earlier kernel
        if tl.load(want_ptr + row) == 0:  # an unwanted row reads no weight
            tl.store(out, tl.zeros((BLOCK_N,), out_ptr.dtype.element_ty), mask=in_cols)
            return
    x_row = x_ptr + row * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    up_offset = N.to(tl.int64) * stride_w  # W_up's first row (SWIGLU)
    # The first (or only) weight slice goes out first: the weights do not change while a step
    # runs, so under PDL it streams in while the kernel that makes x finishes, and without it
    # finding the row's scale waits under it instead of before it.
    w, w_up = _w_slice(w_rows, up_offset, in_cols, K, 0, SWIGLU, EVEN_K, BLOCK_K)
    if not MASKED:
        wait_for_inputs(PDL)
    if UNROLL == 1 and not QUANTIZED:
        x = _x_slice(x_row, K, 0, EVEN_K, BLOCK_K)
        x_scale, inverse = row_scales(tl.max(tl.abs(x), axis=0))
        x = e4m3_value(x, inverse)
        acc = w.to(tl.float32) * x[None, :]
        acc_up = w_up.to(tl.float32) * x[None, :]
    else:
        if QUANTIZED:  # the row's e4m3 values and scale come made (no amax pass)
            x_scale = tl.load(x_scale_ptr + row)
            inverse = 1.0  # `_slice` quantizes nothing
        else:
            # The row's activation scale: its largest |x| (a max: the pass's order is free).
            largest = tl.zeros((BLOCK_K,), dtype=tl.float32)
            if UNROLL:  # every slice's load in flight at once (a loop waits for each in turn)
                for step in tl.static_range(UNROLL):
                    largest = tl.maximum(largest, tl.abs(_x_slice(x_row, K, step * BLOCK_K,
                                                                  EVEN_K, BLOCK_K)))  # fmt: skip
            else:
                for start in range(0, K, BLOCK_K):
                    largest = tl.maximum(largest, tl.abs(_x_slice(x_row, K, start, EVEN_K,
                                                                  BLOCK_K)))  # fmt: skip
            x_scale, inverse = row_scales(tl.max(largest, axis=0))
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc, acc_up = _slice(x_row, inverse, w, w_up, K, 0, acc, acc_up, SWIGLU, QUANTIZED,
                             EVEN_K, BLOCK_K)  # fmt: skip
        # Unrolled, every slice's loads can issue before the first slice's products (bytes in
        # flight are what a GEMV's speed is); the sums keep the same order either way.
        if UNROLL:
            for step in tl.static_range(1, UNROLL):
                w, w_up = _w_slice(w_rows, up_offset, in_cols, K, step * BLOCK_K, SWIGLU,
                                   EVEN_K, BLOCK_K)  # fmt: skip
                acc, acc_up = _slice(x_row, inverse, w, w_up, K, step * BLOCK_K, acc, acc_up,
                                     SWIGLU, QUANTIZED, EVEN_K, BLOCK_K)  # fmt: skip
        else:
            for start in range(BLOCK_K, K, BLOCK_K):
                w, w_up = _w_slice(w_rows, up_offset, in_cols, K, start, SWIGLU, EVEN_K,
                                   BLOCK_K)  # fmt: skip
                acc, acc_up = _slice(x_row, inverse, w, w_up, K, start, acc, acc_up, SWIGLU,
                                     QUANTIZED, EVEN_K, BLOCK_K)  # fmt: skip
    # As `kernels.matmul.linear`: the fp32 sums times the row's scale, then W's, rounded to
    # DTYPE, then SiLU·up.
    value = tl.sum(acc, axis=1) * x_scale * tl.load(scale_ptr + cols, mask=in_cols, other=0.0)
    value = value.to(DTYPE)
    if SWIGLU:
        up = tl.sum(acc_up, axis=1) * x_scale
        up = up * tl.load(scale_ptr + N + cols, mask=in_cols, other=0.0)
        up = up.to(DTYPE).to(tl.float32)
        value = silu_times(value.to(tl.float32), up, DTYPE)
    tl.store(out, value.to(out_ptr.dtype.element_ty), mask=in_cols)


@dataclass(frozen=True, slots=True)
class GemvTiling:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1


# A row's bits depend on the tiling, so it follows W's shape [N, K] only, never M: per Ouro-1.4B
# projection the candidate of `benchmarks.fp8_matmul --gemv --rows 1,2` with the least time summed
# over one and two rows on an H100 (docs/quantization.md), and for other shapes the one whose sum
# over the four was least. Every one is a single K slice but the down projection's (three).
GEMV_TILING = GemvTiling(4, 2048, 4)
GEMV_TILINGS: dict[tuple[int, int], GemvTiling] = {
    (6144, 2048): GemvTiling(8, 2048, 4),  # qkv
    (2048, 2048): GemvTiling(4, 2048, 4),  # o
    (11264, 2048): GemvTiling(4, 2048, 4),  # gate/up
    (2048, 5632): GemvTiling(8, 2048, 4),  # down
}


# K slices up to which the K loop is unrolled (one compile per K then; deeper K loops).
MAX_UNROLL = 16


def gemv_tiling(columns: int, depth: int) -> GemvTiling:
    """The tiling for an [N = columns, K = depth] weight (any M)."""
    return GEMV_TILINGS.get((columns, depth), GEMV_TILING)


def fp8_gemv(
    x: torch.Tensor,  # [M, K] bf16 / fp16 / fp32, or fp8 rows with `x_scale`; contiguous rows
    weight: torch.Tensor,  # [N, K] float8 e4m3
    scale: torch.Tensor,  # [N] fp32: W's scale per row (models.quant)
    rows_wanted: torch.Tensor | None = None,  # [M] bool: compute these rows, zeros elsewhere
    out_dtype: torch.dtype | None = None,  # default `dtype`; the values are rounded to it first
    swiglu: bool = False,  # W = [W_gate; W_up]: silu(x W_gate^T) * x W_up^T, [M, N / 2]
    tiling: GemvTiling | None = None,  # default `gemv_tiling` of W's shape
    x_scale: torch.Tensor | None = None,  # [M] fp32: fp8 rows' scales (`kernels.e4m3`)
    dtype: torch.dtype | None = None,  # fp8 rows: the dtype they came from (default x's)
    pdl: bool = False,  # launch as a programmatic dependent (`kernels.pdl`; SM90+)
) -> torch.Tensor:
    """`models.quant.fp8_linear` of x, [M, N], each row on its own (see the module docstring),
    x quantized in the kernel unless it comes quantized (fp8 with `x_scale`: the same bits);
    with `swiglu`, `fused_ops.silu_mul` of its two halves, each rounded first."""
    rows, depth = x.shape
    columns = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if weight.dtype != FP8 or weight.shape[1] != depth or (swiglu and weight.shape[0] % 2):
        raise ValueError(
            f"fp8_gemv of x {tuple(x.shape)} by W {tuple(weight.shape)} {weight.dtype}: W must "
            "be float8_e4m3fn [N, K]" + (" with N even (swiglu)" if swiglu else "")
        )
    if scale.shape != (weight.shape[0],) or scale.dtype != torch.float32:
        raise ValueError(f"fp8_gemv needs an fp32 [{weight.shape[0]}] scale")
    quantized = x.dtype == FP8
    if (
        quantized != (x_scale is not None)
        or (quantized and dtype is None)
        or (not quantized and dtype not in (None, x.dtype))
    ):
        raise ValueError("fp8_gemv takes fp8 rows with their x_scale and dtype, or 16/32-bit x")
    if x_scale is not None and (x_scale.shape != (rows,) or x_scale.dtype != torch.float32):
        raise ValueError(f"fp8_gemv's x_scale must be fp32 [{rows}]")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("fp8_gemv needs x and W with a contiguous last dimension")
    if rows_wanted is not None and (
        rows_wanted.shape != (rows,) or rows_wanted.dtype != torch.bool
    ):
        raise ValueError(f"fp8_gemv's rows_wanted must be a [{rows}] bool mask")
    dtype = dtype or x.dtype
    out = torch.empty((rows, columns), dtype=out_dtype or dtype, device=x.device)
    if rows == 0:
        return out
    tile = tiling or gemv_tiling(weight.shape[0], depth)
    grid = (rows, triton.cdiv(columns, tile.block_n))
    slices = triton.cdiv(depth, tile.block_k)
    _gemv_kernel[grid](
        x, weight, scale, x if x_scale is None else x_scale, out,
        x if rows_wanted is None else rows_wanted, columns, depth, x.stride(0),
        weight.stride(0), out.stride(0), QUANTIZED=quantized, DTYPE=triton_dtype(dtype),
        MASKED=rows_wanted is not None, SWIGLU=swiglu, EVEN_K=depth % tile.block_k == 0,
        UNROLL=slices if slices <= MAX_UNROLL else 0, PDL=pdl, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, num_warps=tile.num_warps, num_stages=tile.num_stages,
        **launch_options(pdl),
    )  # fmt: skip
    return out
