"""float8 e4m3 rounding in Triton, as `kv.storage.to_cache_dtype` and `models.quant` round in
torch: the fp8 KV cache's values (`kernels.kv_write.cache_value`) and fp8 activations.

Owns: `e4m3_value` (an fp32 value times a reciprocal scale, saturated at +-448, rounded to the
nearest e4m3 value, ties to even, still in fp32), `row_scales` (a row's activation scale and its
reciprocal from its largest magnitude), `store_quantized` (one whole row quantized and stored: what
`quantize_rows` runs, and the kernels that make a projection's input quantize it on the way out,
`kernels.fused_ops`), `quantize_rows` (x [M, K] -> float8 e4m3 rows and their scales:
`models.quant.quantize_activations` bit for bit) and `triton_dtype` (the triton twin of a torch
float dtype, for kernels told which dtype to round to). Must not: divide with Triton's `/` (not
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
def store_quantized(x, mask, out_ptrs, scale_ptr):
    """Quantize one fp32 row `x` [BLOCK] (its values where `mask`) with its own scale: its e4m3
    values to `out_ptrs` (float8) and its scale to `scale_ptr`."""
    scale, inverse = row_scales(tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0))
    tl.store(out_ptrs, e4m3_value(x, inverse).to(out_ptrs.dtype.element_ty), mask)  # exact
    tl.store(scale_ptr, scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    store_quantized(x, mask, out_ptr + row * stride_out + cols, scale_ptr + row)


# Widest row `quantize_rows` (or a kernel that quantizes its output rows) loads in one block
# (Ouro's down projection reads 5,632, Huginn's 17,920).
MAX_ROW = 32768


def row_warps(block: int) -> int:
    """Warps for a program that holds a whole row of `block` values (at most 64 a thread)."""
    return 4 if block < 4096 else 8 if block < 16384 else 16


def empty_rows(rows: int, depth: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for `rows` quantized rows of `depth` values: (float8 [M, K], fp32 scales [M])."""
    if depth > MAX_ROW:
        raise ValueError(
            f"rows of at most {MAX_ROW} values are quantized in one block, not {depth}"
        )
    return (
        torch.empty((rows, depth), dtype=FP8, device=device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype, contiguous last dimension) -> (x8 [M, K] float8 e4m3, scale [M]
    fp32), one program a row; x ~ x8 * scale[:, None]."""
    rows, depth = x.shape
    if depth > MAX_ROW or x.stride(1) != 1:
        raise ValueError(
            f"quantize_rows takes rows of at most {MAX_ROW} contiguous values, got "
            f"{tuple(x.shape)} with strides {x.stride()}"
        )
    out, scale = empty_rows(rows, depth, x.device)
    if rows:
        block = triton.next_power_of_2(depth)
        _quantize_rows_kernel[(rows,)](
            x, out, scale, depth, x.stride(0), out.stride(0), BLOCK=block,
            num_warps=row_warps(block),
        )  # fmt: skip
    return out, scale


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    """The triton dtype of a 16- or 32-bit torch float dtype (a kernel's rounding constexpr)."""
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"no rounding to {dtype}: fp32, bf16 or fp16")
    return _TRITON_DTYPES[dtype]
