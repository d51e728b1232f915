"""float8 e4m3 rounding in Triton, as `kv.storage.to_cache_dtype` and `models.quant` round in
torch: the fp8 KV cache's values (`kernels.kv_write.cache_value`) and fp8 activations.

Owns: `e4m3_value` (an fp32 value times a reciprocal scale, saturated at +-448, rounded to the
nearest e4m3 value, ties to even, still in fp32), `row_scales` (a row's activation scale and its
reciprocal from its largest magnitude) and `quantize_rows` (x [M, K] -> e4m3 rows and their scales:
`models.quant.quantize_activations` bit for bit; the e4m3 values stored as float8, or in x's dtype,
which holds each exactly, for `kernels.matmul.linear`). Must not: divide with Triton's `/` (not
correctly rounded on a GPU): the one division is `div_rn`, torch's IEEE division."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.kv.storage import FP8


@triton.jit
def e4m3_grid(x, signed):
    """fp32 `x` (|x| <= 448) rounded to the nearest float8 e4m3 value, ties to even, in fp32
    arithmetic, so that a conversion after it is exact: triton's CPU interpreter (3.9) does not
    carry a rounding into the exponent (7.78 became 4.0, not 8.0). The sign is `signed`'s (x
    before its positive scale), set as a bit: compiled for the H200, -0.0 times the scale came
    out as a stored +0 where torch stores -0 (the float negation of a zero is not kept)."""
    sign = signed.to(tl.int32, bitcast=True) & -0x80000000
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # 3 mantissa bits, ties to even
    subnormal = (magnitude + 24576.0) - 24576.0  # below 2**-6: multiples of 2**-9 (1.5 * 2**14)
    grid = tl.where(magnitude < 0.015625, subnormal.to(tl.int32, bitcast=True), rounded)
    return (grid | sign).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_value(x, inverse_scale):
    """fp32 `x` as e4m3 stores it (in fp32): times `inverse_scale` in fp32, saturated at +-448,
    rounded to nearest, ties to even."""
    return e4m3_grid(tl.clamp(x * inverse_scale, -448.0, 448.0), x)


@triton.jit
def row_scales(amax):
    """(scale, inverse): amax times fp32(1 / 448), and 448 / amax correctly rounded; (1, 1) for a
    row of zeros."""
    safe = tl.where(amax > 0.0, amax, 448.0)
    return safe * (1.0 / 448.0), tl.math.div_rn(448.0, safe)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale, inverse = row_scales(tl.max(tl.abs(x), axis=0))
    value = e4m3_value(x, inverse).to(out_ptr.dtype.element_ty)  # exact: on e4m3's grid
    tl.store(out_ptr + row * stride_out + cols, value, mask)
    tl.store(scale_ptr + row, scale)


# Widest row `quantize_rows` loads in one block (Ouro's down projection reads 5,632).
MAX_ROW = 16384


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, contiguous last dimension) -> (x8 [M, K], scale [M] fp32), one
    program a row; x ~ x8 * scale[:, None]. The e4m3 values are stored as `dtype`: float8, or
    x's dtype."""
    rows, depth = x.shape
    if depth > MAX_ROW or x.stride(1) != 1:
        raise ValueError(
            f"quantize_rows takes rows of at most {MAX_ROW} contiguous values, got "
            f"{tuple(x.shape)} with strides {x.stride()}"
        )
    if dtype not in (FP8, x.dtype):
        raise ValueError(f"quantize_rows stores float8 or x's dtype ({x.dtype}), not {dtype}")
    out = torch.empty((rows, depth), dtype=dtype, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(depth)
        _quantize_rows_kernel[(rows,)](
            x, out, scale, depth, x.stride(0), out.stride(0), BLOCK=block,
            num_warps=8 if block >= 4096 else 4,
        )  # fmt: skip
    return out, scale
