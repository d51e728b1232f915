"""Triton kernels for the elementwise and row-wise parts of a layer, each one launch.

Owns: RMSNorm, residual-add + two RMSNorms (or one, for a pre-norm layer), rotate-half RoPE (in
place; q and k in one launch
when they are views of one projection) and SiLU(gate) * up, and the jit helpers that hold their
arithmetic (`silu_times` is also `kernels.matmul`'s SwiGLU epilogue, so both round alike). The
residual add and SiLU·up can also quantize their output rows for an fp8 projection
(`kernels.e4m3.store_quantized`, `models.quant`'s rule), which then needs no launch of its own to
do it: one program holds the whole row, so it knows the row's largest value.
Must not: change the math of the torch ops they replace. Every kernel computes in fp32 and rounds
to the tensor dtype exactly where the torch code rounds (after the normalisation, after each
product, after the sum), so in bf16 the results follow the HF rounding order; a row is always
reduced by one program in one order, so results do not depend on the batch.

Shapes: T rows (tokens), H hidden size, I intermediate size, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.kernels.e4m3 import empty_rows, row_warps, store_quantized
from loopserve.kernels.pdl import launch_dependents, launch_options, wait_for_inputs

Rows = tuple[torch.Tensor, torch.Tensor]  # quantized rows: float8 [T, size] and fp32 scales [T]


@triton.jit
def inverse_rms(x, mask, size, eps):
    """rsqrt(mean(x^2) + eps) of one row, x fp32 [BLOCK]. A kernel that calls it on the same
    [BLOCK] row shape reduces a row in the same order (the norm-prologue matmul measured in
    docs/latency.md did)."""
    x = tl.where(mask, x, 0.0)
    return tl.rsqrt(tl.sum(x * x, axis=0) / size + eps)


@triton.jit
def scale(x, inverse, weight, DTYPE: tl.constexpr):
    """w * cast(x * inverse) with the HF rounding (elementwise: any shape that broadcasts)."""
    normalised = (x * inverse).to(DTYPE).to(tl.float32)
    return (weight * normalised).to(DTYPE)


@triton.jit
def _normalise(x, weight, mask, size, eps, DTYPE: tl.constexpr):
    """w * cast(x * rsqrt(mean(x^2) + eps)) with the HF rounding; x, weight fp32 [BLOCK]."""
    return scale(x, inverse_rms(x, mask, size, eps), weight, DTYPE)


@triton.jit
def add_normalised(update, residual, update_weight, update_inverse, DTYPE: tl.constexpr):
    """residual + norm_u(update) rounded to DTYPE, fp32 operands, given norm_u's inverse RMS."""
    normed_update = scale(update, update_inverse, update_weight, DTYPE).to(tl.float32)
    return (residual + normed_update).to(DTYPE)


@triton.jit
def silu_times(gate, up, DTYPE: tl.constexpr):
    """cast(cast(silu(gate)) * up), fp32 operands: SiLU·up with torch's rounding."""
    activated = (gate / (1.0 + tl.exp(-gate))).to(DTYPE).to(tl.float32)
    return (activated * up).to(DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, e4m3_ptr, e4m3_scale_ptr, stride_x, stride_out, size, eps,
    QUANTIZE: tl.constexpr,  # also the output rows quantized (float8 + scales)
    PDL: tl.constexpr,  # launched as a programmatic dependent (`kernels.pdl`)
    BLOCK: tl.constexpr,
):  # fmt: skip
    launch_dependents(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalise(x, weight, mask, size, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
    if QUANTIZE:
        store_quantized(out.to(tl.float32), mask, e4m3_ptr + row * size + cols,
                        e4m3_scale_ptr + row)  # fmt: skip


@triton.jit
def _add_norm_kernel(
    update_ptr,  # [T, H] the sublayer output
    residual_ptr,  # [T, H]
    update_weight_ptr,
    out_weight_ptr,
    sum_ptr,  # [T, H] residual + norm_u(update)
    normed_ptr,  # [T, H] norm_o(sum)
    e4m3_ptr,  # [T, H] float8 (QUANTIZE): norm_o(sum) quantized per row
    e4m3_scale_ptr,  # [T] fp32 (QUANTIZE): its scales
    stride_update,
    stride_residual,
    size,
    eps,
    NORM_UPDATE: tl.constexpr,  # False: a pre-norm layer adds the update as it is
    QUANTIZE: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent (`kernels.pdl`)
    BLOCK: tl.constexpr,
):
    launch_dependents(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < size
    dtype = sum_ptr.dtype.element_ty
    update = tl.load(update_ptr + row * stride_update + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
    out_weight = tl.load(out_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_UPDATE:
        update_weight = tl.load(update_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        update_inverse = inverse_rms(update, mask, size, eps)
        total = add_normalised(
            update, residual.to(tl.float32), update_weight, update_inverse, dtype
        )
    else:
        total = (residual.to(tl.float32) + update).to(dtype)
    tl.store(sum_ptr + row * size + cols, total, mask=mask)
    normed = _normalise(total.to(tl.float32), out_weight, mask, size, eps, dtype)
    tl.store(normed_ptr + row * size + cols, normed, mask=mask)
    if QUANTIZE:
        store_quantized(normed.to(tl.float32), mask, e4m3_ptr + row * size + cols,
                        e4m3_scale_ptr + row)  # fmt: skip


@triton.jit
def _rope(x, rotated, cos, sin, dtype: tl.constexpr):
    """x * cos + rotated * sin (all fp32; rotated = rotate_half(x) at the same element) in dtype.
    In 16-bit dtypes each product and the sum are rounded to the dtype like the torch ops; in
    fp32 the sum is an explicit fma(x, cos, rotated * sin), so no kernel that uses this can
    contract it differently (the rotary kernel and the decode kernel give the same bits)."""
    if dtype == tl.float32:
        return tl.fma(x, cos, rotated * sin)
    return ((x * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def rotate_half(x_ptrs, cos_ptrs, sin_ptrs, dims, mask, half):
    """RoPE of the head vectors at `x_ptrs + dims` (dims [..., BLOCK_D], 0 <= dims < 2 * half
    where `mask`), rotate_half(x) = [-second, first]; cos/sin: the token's angle rows. Returns
    the rotated values (x's dtype); reads each element's partner, so callers that store in place
    must let every thread read first."""
    first_half = dims < half
    partner = tl.where(first_half, dims + half, dims - half)
    x = tl.load(x_ptrs + dims, mask=mask, other=0.0).to(tl.float32)
    other = tl.load(x_ptrs + partner, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptrs + dims, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptrs + dims, mask=mask, other=0.0).to(tl.float32)
    return _rope(x, tl.where(first_half, -other, other), cos, sin, x_ptrs.dtype.element_ty)


@triton.jit
def _rotary_kernel(
    x_ptr,  # [T, heads, D], rotated in place
    cos_ptr,  # [T, D]
    sin_ptr,
    stride_token,
    stride_head,
    stride_angle,
    heads,
    half,  # D / 2
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # the next power of two >= half
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, BLOCK_HEADS)[:, None]
    dim = tl.arange(0, BLOCK_HALF)[None, :]
    in_dim = dim < half
    mask = (head < heads) & in_dim
    dtype = x_ptr.dtype.element_ty
    base = x_ptr + token * stride_token + head * stride_head
    # Each thread holds an element and its partner, so the in-place stores need no barrier.
    first = tl.load(base + dim, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(base + half + dim, mask=mask, other=0.0).to(tl.float32)
    angle = token * stride_angle + dim
    cos_first = tl.load(cos_ptr + angle, mask=in_dim, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_ptr + angle + half, mask=in_dim, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_ptr + angle, mask=in_dim, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_ptr + angle + half, mask=in_dim, other=0.0).to(tl.float32)
    tl.store(base + dim, _rope(first, -second, cos_first, sin_first, dtype), mask=mask)
    tl.store(base + half + dim, _rope(second, first, cos_second, sin_second, dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, e4m3_ptr, e4m3_scale_ptr, stride_gate, stride_up, size,
    QUANTIZE: tl.constexpr,  # also the rows quantized (float8 + scales); one block holds a row
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    activated = silu_times(gate, up, dtype)
    tl.store(out_ptr + row * size + cols, activated, mask=mask)
    if QUANTIZE:
        store_quantized(activated.to(tl.float32), mask, e4m3_ptr + row * size + cols,
                        e4m3_scale_ptr + row)  # fmt: skip


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quantize: bool = False, pdl: bool = False
) -> tuple[torch.Tensor, Rows | None]:
    """x [T, H] (last dim contiguous) -> ([T, H], with `quantize` its rows quantized as
    `kernels.e4m3.quantize_rows` would); `pdl`: launched as a programmatic dependent."""
    rows, size = x.shape
    out = torch.empty((rows, size), dtype=x.dtype, device=x.device)
    quantized = empty_rows(rows, size, x.device) if quantize else None
    e4m3, e4m3_scale = quantized or (out, out)
    if rows:
        block = triton.next_power_of_2(size)
        _rms_norm_kernel[(rows,)](
            x, weight, out, e4m3, e4m3_scale, x.stride(0), out.stride(0), size, eps,
            QUANTIZE=quantize, PDL=pdl, BLOCK=block, **launch_options(pdl),
        )  # fmt: skip
    return out, quantized


def add_norm(
    update: torch.Tensor,
    residual: torch.Tensor,
    update_weight: torch.Tensor | None,
    out_weight: torch.Tensor,
    eps: float,
    quantize: bool = False,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Rows | None]:
    """(residual + norm_u(update), norm_o of that, with `quantize` the latter's rows quantized
    as `kernels.e4m3.quantize_rows` would); all [T, H]. Without `update_weight` the update is
    added as it is (a pre-norm layer's residual). `pdl`: launched as a programmatic dependent."""
    rows, size = update.shape
    total = torch.empty((rows, size), dtype=update.dtype, device=update.device)
    normed = torch.empty_like(total)
    quantized = empty_rows(rows, size, update.device) if quantize else None
    e4m3, e4m3_scale = quantized or (total, total)
    if rows:
        _add_norm_kernel[(rows,)](
            update, residual, out_weight if update_weight is None else update_weight,
            out_weight, total, normed, e4m3, e4m3_scale, update.stride(0), residual.stride(0),
            size, eps, NORM_UPDATE=update_weight is not None, QUANTIZE=quantize, PDL=pdl,
            BLOCK=triton.next_power_of_2(size), **launch_options(pdl),
        )  # fmt: skip
    return total, normed, quantized


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place (any token/head strides, contiguous D); cos/sin [T, D]."""
    tokens, heads, head_dim = x.shape
    if tokens:
        _rotary_kernel[(tokens,)](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads, head_dim // 2,
            BLOCK_HEADS=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )  # fmt: skip
    return x


def rotary_qk_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Nq, D] and k [T, Nkv, D] in place, in one launch when k's heads follow q's
    in memory with the same strides (views of one fused projection); every element gets the
    same arithmetic either way, so the results are those of two `rotary_` calls."""
    tokens, q_heads, head_dim = q.shape
    follows = (
        k.dtype == q.dtype
        and k.stride() == q.stride()
        and k.shape[0] == tokens
        and k.shape[2] == head_dim
        and k.data_ptr() == q.data_ptr() + q_heads * q.stride(1) * q.element_size()
    )
    if follows:
        rotary_(q.as_strided((tokens, q_heads + k.shape[1], head_dim), q.stride()), cos, sin)
    else:
        rotary_(q, cos, sin)
        rotary_(k, cos, sin)
    return q, k


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] views (contiguous last dim)."""
    return silu_mul_rows(gate, up, quantize=False)[0]


def silu_mul_rows(
    gate: torch.Tensor, up: torch.Tensor, quantize: bool
) -> tuple[torch.Tensor, Rows | None]:
    """`silu_mul`, and with `quantize` its rows quantized as `kernels.e4m3.quantize_rows` would
    (then one program holds a whole row, so it knows the row's largest value)."""
    rows, size = gate.shape
    out = torch.empty((rows, size), dtype=gate.dtype, device=gate.device)
    quantized = empty_rows(rows, size, gate.device) if quantize else None
    e4m3, e4m3_scale = quantized or (out, out)
    if rows:
        block = triton.next_power_of_2(size)
        block = block if quantize else min(2048, block)
        grid = (rows, triton.cdiv(size, block))
        _silu_mul_kernel[grid](
            gate, up, out, e4m3, e4m3_scale, gate.stride(0), up.stride(0), size,
            QUANTIZE=quantize, BLOCK=block, num_warps=row_warps(block),
        )  # fmt: skip
    return out, quantized
