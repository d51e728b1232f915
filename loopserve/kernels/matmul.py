"""A batch-invariant matmul: y = x W^T (+ b) whose row bits never depend on how many rows share it.

Owns: `linear` (x [M, K] times W [N, K] transposed, optional fp32 bias) and `silu_mul_linear` (the
down projection with SiLU(gate) * up computed on the way in, `fused_ops.silu_times`'s bits), and
the tiling each row count gets. Must not: split K, or reduce a row in an order that depends on
M. Each output is one program's fp32 accumulator over K in order, chunk after chunk, each chunk a
`tl.dot` (the tensor cores add 16-wide k slices in order), so the tiling (block rows, columns,
depth) may change with M while a row's bits do not. tests/kernels/test_matmul.py holds rows of
every tiling to the same row alone, bit for bit, and the values to torch's matmul.

Why: cuBLAS picks its kernel, and for some shapes its split of K, by M. At Ouro-1.4B's down
projection (K = 5,632) on the H200 rows of 96 or more get other bits than rows of up to 64, so a
request in a large batch can generate other tokens than alone (docs/latency.md, "Batch
invariance at full size"). The engine's `batch_invariant` setting runs the down projection and
the exit gate here (the other weight matmuls keep one order at every M under cuBLAS, which
tests/gpu/test_invariance_full_size.py checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loopserve.kernels.fused_ops import silu_times


@triton.jit
def _matmul_kernel(
    a_ptr, up_ptr, w_ptr, bias_ptr, out_ptr,
    M, N, K, stride_a, stride_up, stride_w, stride_out,
    SILU: tl.constexpr, BIAS: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,  # CPU tensors (the interpreter): dot operands in fp32, see `_launch`
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows, in_cols = rows < M, cols < N
    a_rows = rows.to(tl.int64)[:, None]
    w_cols = cols.to(tl.int64)[None, :] * stride_w
    dtype = w_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        depth = start + tl.arange(0, BLOCK_K)
        # A K mask on the contiguous dimension would cost the loads their vector width.
        in_depth = depth < K if not EVEN_K else tl.full((BLOCK_K,), True, tl.int1)
        a_mask = in_rows[:, None] & in_depth[None, :]
        a = tl.load(a_ptr + a_rows * stride_a + depth[None, :], mask=a_mask, other=0.0)
        if SILU:
            up = tl.load(up_ptr + a_rows * stride_up + depth[None, :], mask=a_mask, other=0.0)
            a = silu_times(a.to(tl.float32), up.to(tl.float32), dtype)
        a = a.to(dtype)  # the exit gate's bf16 hidden state meets fp32 weights
        w_mask = in_depth[:, None] & in_cols[None, :]
        w = tl.load(w_ptr + w_cols + depth[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if IEEE:  # noqa: SIM108 (a constexpr branch; no tf32 for fp32 weights)
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    if BIAS:
        acc += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


@dataclass(frozen=True, slots=True)
class Tiling:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiling_for(rows: int, columns: int, dtype: torch.dtype) -> Tiling:
    """The tiling of a call over `rows` rows (any choice gives the same bits; this is speed).
    Few rows: thin column blocks and deep K slices, so a weight of 2,048 columns still spreads
    over ~128 programs with enough bytes in flight each; many rows: square-ish blocks."""
    if dtype == torch.float32:  # the engine's exactness runs; fp32 dots have no fast path
        return Tiling(16 if rows <= 16 else 32, 32, 32, 4, 2)
    if rows <= 16:
        return Tiling(16, 16, 256, 4, 4)
    if rows <= 256:
        return Tiling(64, 16 if columns <= 4096 else 64, 128, 4, 3)
    return Tiling(128, 64, 64, 8, 3)


def _launch(
    a: torch.Tensor,
    up: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    tiling: Tiling | None,
) -> torch.Tensor:
    rows, depth = a.shape
    columns = weight.shape[0]
    if weight.shape[1] != depth or a.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            f"linear of x {tuple(a.shape)} by W {tuple(weight.shape)}: W must be [N, K] and "
            "both must have a contiguous last dimension"
        )
    out = torch.empty((rows, columns), dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    tile = tiling or tiling_for(rows, columns, weight.dtype)
    grid = (triton.cdiv(columns, tile.block_n), triton.cdiv(rows, tile.block_m))
    _matmul_kernel[grid](
        a, up if up is not None else a, weight, bias if bias is not None else weight, out,
        rows, columns, depth, a.stride(0), up.stride(0) if up is not None else 0,
        weight.stride(0), out.stride(0),
        SILU=up is not None, BIAS=bias is not None, IEEE=weight.dtype == torch.float32,
        # triton 3.9's interpreter multiplies 16-bit dot operands as integer bit patterns; fp32
        # operands are exact for bf16 / fp16 values.
        UPCAST=a.device.type == "cpu", EVEN_K=depth % tile.block_k == 0,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out


def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) in W's dtype, [M, N]; x is cast to W's dtype on the way in."""
    return _launch(x, None, weight, bias, weight.dtype, tiling)


def silu_mul_linear(
    gate: torch.Tensor,  # [M, I]
    up: torch.Tensor,  # [M, I]
    weight: torch.Tensor,  # [N, I]
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """(silu(gate) * up) W^T with `fused_ops.silu_mul`'s bits for the product, [M, N]."""
    if up.shape != gate.shape or up.stride(1) != 1:
        raise ValueError("silu_mul_linear needs gate and up of one shape, last dim contiguous")
    return _launch(gate, up, weight, None, weight.dtype, tiling)
