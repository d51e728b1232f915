"""Batch-invariant matmuls: row bits that never depend on how many rows share the call.

Owns: `linear` (x [M, K] times W [N, K] transposed, rounded to x's dtype; W in x's dtype, or fp8
e4m3 times fp8 rows (`kernels.e4m3.quantize_rows`), with a scale per row of each that multiplies
the fp32 sums, rounded to the dtype the rows came from (`models.quant`); optionally only the
rows a mask asks for; optionally SiLU·up of a fused gate/up projection's halves as the epilogue),
`gate_logit` (the exit gate's fp32 h·w + b, optionally its sigmoid, one program per row) and the
tiling each row count gets. Must not: split K, or
reduce a row in an order that depends on M. In `linear` each output is one program's fp32
accumulator over K in order, chunk after chunk, each chunk a `tl.dot` (the tensor cores add
16-wide k slices in order), so the tiling (block rows, columns, depth) may change with M while a
row's bits do not; measured so on the H200. tests/kernels/test_matmul.py holds rows of every
tiling to the same row alone, bit for bit (GPU), and the values to torch's (CPU and GPU). With an
fp8 W a row's bits do change with the tiling (fp8 dots most of all), so an fp8 W gets one tiling
at every M unless the caller picks one (`fp8_tiling`).

Why: cuBLAS picks its kernel, and for some shapes its split of K, by M. At Ouro-1.4B's down
projection (K = 5,632) on the H200 rows of 96 or more get other bits than rows of up to 64, so a
request in a large batch can generate other tokens than alone (docs/latency.md, "Batch
invariance at full size"). The engine's `batch_invariant` setting runs the down projection here
(the other weight matmuls keep one order at every M under cuBLAS, which
tests/gpu/test_invariance_full_size.py checks); the exit gate runs here wherever the layer ops
are fused (`models.ops.TritonOps`), being faster than cuBLAS's fp32 GEMV at every row count.
SiLU·up in the down projection's prologue was 4x slower at one row (every column block
recomputed it for its rows); as the gate/up projection's epilogue (`swiglu`) it is faster than
cuBLAS + `silu_mul` at up to 16 rows, where `models.ops.TritonOps` runs it.

cuBLAS's bits. For Ouro's qkv, o and gate/up shapes this kernel gives cuBLAS's bits at every row
count measured on the H200 (one `nvjet` kernel, one accumulator chain over K, as here), so the
engine may switch between the two by row count without a row's bits depending on its batch; the
down projection only where cuBLAS does not split K (docs/latency.md, "Norms and SiLU·up into the
matmuls"; tests/kernels/test_matmul.py holds it on the GPU).

The LM head runs here wherever the layer ops are fused (`models.ops.TritonOps`), with `rows_wanted`:
a decode step needs logits only for the rows whose token exits after this loop (at fixed depth 4 and
one row, one step in four), and cuBLAS cannot be told to skip work from a device mask inside a CUDA
graph. A program whose rows are all unwanted stores zeros and returns before reading any weight;
wanted rows keep an unmasked call's bits, because the mask never enters the K loop (two versions
that put it there, as a trip count or as load masks, gave other bits per tiling on the H200).
tests/kernels/test_matmul.py holds the rows to one set of bits at every M, with and without a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loopserve.kernels.e4m3 import triton_dtype
from loopserve.kernels.fused_ops import silu_times
from loopserve.kv.storage import FP8


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr, FP8_DOT: tl.constexpr,
         FP8_SUMS: tl.constexpr, DTYPE: tl.constexpr):  # fmt: skip
    """acc + a w: one chunk of the K loop (fp32 operands under the interpreter; no tf32). fp8
    operands are widened to DTYPE first, which holds every e4m3 value exactly, unless FP8_DOT:
    then the tensor cores multiply fp8 by fp8 (compute capability 8.9+), adding in their own
    order, so the bits
    are not the widened dot's. Their fp8 sums keep fewer bits than fp32 (left to run over all of
    K, an H100 put outputs of Ouro's o projection 0.03 from the exact sums); every FP8_SUMS of K
    they are added into the fp32 accumulator, as cuBLAS does unless told to be fast."""
    if UPCAST:
        a, w = a.to(tl.float32), w.to(tl.float32)
    elif FP8_DOT:
        return tl.dot(a, w, acc, max_num_imprecise_acc=FP8_SUMS)
    else:
        a, w = a.to(DTYPE), w.to(DTYPE)
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _matmul_kernel(
    a_ptr, w_ptr, scale_ptr, a_scale_ptr, out_ptr, want_ptr, M, N, K, stride_a, stride_w,
    stride_out,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,  # CPU tensors (the interpreter): dot operands in fp32, see `linear`
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    MASKED: tl.constexpr,  # want_ptr: which rows to compute; the others get zeros
    SWIGLU: tl.constexpr,  # W = [W_gate; W_up], N = W's rows / 2: out = silu(x W_gate^T) * x W_up^T
    SCALED: tl.constexpr,  # an fp8 W: a_scale_ptr / scale_ptr, a's and W's fp32 scales per row
    FP8_DOT: tl.constexpr,  # fp8 a and W multiplied as fp8 (see `_dot`)
    FP8_SUMS: tl.constexpr,  # FP8_DOT: K between the fp8 sums' promotions to fp32
    DTYPE: tl.constexpr,  # what the sums round to: a's dtype, or the dtype fp8 rows came from
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows, in_cols = rows < M, cols < N
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    out_mask = in_rows[:, None] & in_cols[None, :]
    wanted = in_rows
    if MASKED:
        wanted = in_rows & (tl.load(want_ptr + rows, mask=in_rows, other=0) != 0)
        if tl.max(wanted.to(tl.int32), axis=0) == 0:  # no row wanted: no weight read
            tl.store(out, tl.zeros((BLOCK_M, BLOCK_N), out_ptr.dtype.element_ty), mask=out_mask)
            return
    # The loop never sees the mask (loads and trip count as unmasked; a mask inside it compiled
    # to other bits on the H200), so a wanted row has an unmasked call's bits.
    a_rows = rows.to(tl.int64)[:, None]
    w_cols = cols.to(tl.int64)[None, :] * stride_w
    up_offset = N.to(tl.int64) * stride_w  # W_up's first row (SWIGLU)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        depth = start + tl.arange(0, BLOCK_K)
        # No K mask when K divides: a mask on the contiguous dimension may narrow the loads
        # (unmeasured alone; in the first version, SiLU·up in the prologue, it changed nothing).
        in_depth = depth < K if not EVEN_K else tl.full((BLOCK_K,), True, tl.int1)
        a_mask = in_rows[:, None] & in_depth[None, :]
        a = tl.load(a_ptr + a_rows * stride_a + depth[None, :], mask=a_mask, other=0.0)
        w_mask = in_depth[:, None] & in_cols[None, :]
        w = tl.load(w_ptr + w_cols + depth[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = _dot(a, w, acc, IEEE, UPCAST, FP8_DOT, FP8_SUMS, DTYPE)
        if SWIGLU:
            w_up = tl.load(w_ptr + up_offset + w_cols + depth[:, None], mask=w_mask, other=0.0)
            acc_up = _dot(a, w_up, acc_up, IEEE, UPCAST, FP8_DOT, FP8_SUMS, DTYPE)
    # Rounded to DTYPE first, so an fp32 output holds what `F.linear(...).float()` would;
    # SiLU·up then rounds as `fused_ops.silu_mul` does on those rounded halves. With an fp8 W the
    # scales multiply the fp32 sums before that rounding, a's then W's (`models.quant`).
    if SCALED:
        a_scale = tl.load(a_scale_ptr + rows, mask=in_rows, other=0.0)[:, None]
        acc = acc * a_scale * tl.load(scale_ptr + cols, mask=in_cols, other=0.0)[None, :]
        if SWIGLU:
            up_scale = tl.load(scale_ptr + N + cols, mask=in_cols, other=0.0)[None, :]
            acc_up = acc_up * a_scale * up_scale
    value = acc.to(DTYPE)
    if SWIGLU:
        up = acc_up.to(DTYPE).to(tl.float32)
        value = silu_times(value.to(tl.float32), up, DTYPE)
    value = tl.where(wanted[:, None], value, 0.0)
    tl.store(out, value.to(out_ptr.dtype.element_ty), mask=out_mask)


# Columns from which a weight counts as wide (an LM head) for `tiling_for`.
WIDE = 16384


@dataclass(frozen=True, slots=True)
class Tiling:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    fp8_dot: bool = False  # fp8 rows times an fp8 W on the tensor cores as fp8 (`_dot`)
    fp8_sums: int = 32  # with fp8_dot: K between the fp8 sums' promotions to fp32 (`_dot`)


def tiling_for(rows: int, columns: int, dtype: torch.dtype, swiglu: bool = False) -> Tiling:
    """The tiling of a call over `rows` rows (any choice gives the same bits; this is speed).
    Few rows: thin column blocks and deep K slices, so a weight of 2,048 columns still spreads
    over ~128 programs with enough bytes in flight each (the best of eight tilings at one and at
    128 rows of Ouro-1.4B's down projection on the H200); more than 128 rows: square-ish blocks,
    whose weight tiles are not re-read per 16 rows (at 512 rows 47.6 µs against the thin blocks'
    59.6 at 256; the best tiling here is unmeasured). Wide weights (the LM head, 49,152 columns):
    the best of ten tilings at 1 to 128 rows on the H200 (docs/latency.md, "The LM head only
    where a row exits"). SiLU·up's gate/up projection at up to 16 rows: the best of six tilings
    at 1, 4, 8 and 16 rows of Ouro-1.4B's on the H200 (docs/latency.md, "Norms and SiLU·up into
    the matmuls")."""
    if dtype == torch.float32:  # the engine's exactness runs; fp32 dots have no fast path
        return Tiling(16 if rows <= 16 else 32, 32, 32, 4, 2)
    if columns >= WIDE:
        if rows <= 16:
            return Tiling(16, 32, 256, 4, 3)
        return Tiling(64, 128, 64, 4, 3) if rows <= 64 else Tiling(128, 128, 64, 8, 3)
    if rows <= 16:
        return Tiling(16, 32, 128, 4, 3) if swiglu else Tiling(16, 16, 256, 4, 4)
    if rows <= 128:
        return Tiling(16, 32, 128, 4, 3)
    return Tiling(128, 64, 64, 8, 3)


# fp8 weights where the GPU multiplies fp8 by fp8 (compute capability 8.9 and up; the CPU
# interpreter widens to fp32 instead): fp8 rows by the fp8 weight on the tensor cores, the fp8 sums
# added into fp32 every 32 of K (`_dot`). `benchmarks.fp8_matmul --made-rows` on an H100 (calls L
# and N, summed over Ouro-1.4B's four projections): at 16 rows the few-row tiling took 40.5 µs
# where cuBLAS's fp8 matmul took 52.5, cuBLAS bf16 53.4 and the widening tilings below ~90 on fp8
# rows (at 1 and 2 rows 40.8 and 40.4 with the sums left in fp8); at 128 rows the best fp8-dot
# tiling took 66.2 against cuBLAS fp8's 52.6 (49.1 with the sums left in fp8 over all of K, which
# cost accuracy). The larger tiling is what `batch_invariant` runs at every row count (so a row's
# bits do not depend on M; tests/kernels/test_fp8_matmul.py holds that on the GPU) and what runs
# past 16 rows where cuBLAS's fp8 matmul does not.
FP8_DOT_FEW_TILING = Tiling(16, 32, 256, 4, 3, fp8_dot=True)  # up to 16 rows
FP8_DOT_TILING = Tiling(64, 64, 256, 4, 3, fp8_dot=True)
# Elsewhere (fp32 rows, the exactness runs, take fp32's tiling): both operands widened to the
# rows' dtype in registers. One tiling at every row count where a row's bits must not follow its
# batch; the best or within 5 % of the best at 1 to 32 rows on the H200 when the rows were fed
# as bf16 (fp8 rows widened in registers cost more: 90 µs at 1-16 rows on an H100).
FP8_TILING = Tiling(16, 32, 256, 4, 3)
# Where a row's bits may follow its batch, prompt chunks and large decode batches take tilings
# that do not re-read the weights per 16 rows: of `benchmarks.fp8_matmul`'s candidates, the best
# summed over Ouro-1.4B's four projections at 128 rows (110.7 against FP8_TILING's 148.1 µs on an
# H100, bf16 rows) and at 512 (216.5 against 518.3 µs).
FP8_MID_TILING = Tiling(32, 64, 128, 4, 3)  # 17 to 128 rows
FP8_MANY_TILING = Tiling(128, 64, 64, 8, 3)


def fp8_dots(device: torch.device) -> bool:
    """Whether `FP8_DOT_TILING` runs on `device`: a GPU of compute capability 8.9 or more, or
    the CPU (the interpreter, which widens the operands to fp32)."""
    return device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_tiling(rows: int, invariant: bool, dots: bool) -> Tiling:
    """An fp8 weight's tiling over `rows` 16-bit rows: where fp8 `dots` run, `FP8_DOT_TILING` at
    every row count where a row's bits must not depend on M (`invariant`), else by row count;
    without them, `FP8_TILING` at every row count where invariant, else by row count."""
    if dots:
        return FP8_DOT_TILING if invariant or rows > 16 else FP8_DOT_FEW_TILING
    if invariant or rows <= 16:
        return FP8_TILING
    return FP8_MID_TILING if rows <= 128 else FP8_MANY_TILING


def linear(
    x: torch.Tensor,  # [M, K]; with an fp8 W, fp8 rows (`kernels.e4m3.quantize_rows`)
    weight: torch.Tensor,  # [N, K], x's dtype, or float8 e4m3 with `scale`
    tiling: Tiling | None = None,
    rows_wanted: torch.Tensor | None = None,  # [M] bool: compute these rows, zeros elsewhere
    out_dtype: torch.dtype | None = None,  # default `dtype`; the values are rounded to it first
    swiglu: bool = False,  # W = [W_gate; W_up]: silu(x W_gate^T) * x W_up^T, [M, N / 2]
    scale: torch.Tensor | None = None,  # [N] fp32: an fp8 W's scale per row (models.quant)
    x_scale: torch.Tensor | None = None,  # [M] fp32: x's scale per row, with an fp8 W
    dtype: torch.dtype | None = None,  # fp8 rows: the dtype they came from (bf16, fp16, fp32)
) -> torch.Tensor:
    """x W^T, [M, N] (an fp8 W: ((x W^T) * x_scale) * scale, the fp32 sums scaled), rounded to
    x's dtype (fp8 rows: to `dtype`); with `swiglu`, `fused_ops.silu_mul` of its two halves,
    [M, N / 2], each half rounded first as a separate matmul's output would be."""
    rows, depth = x.shape
    columns = weight.shape[0] // 2 if swiglu else weight.shape[0]
    fp8 = weight.dtype == FP8
    if (
        weight.shape[1] != depth
        or (swiglu and weight.shape[0] % 2)
        or (not fp8 and weight.dtype != x.dtype)
        or (fp8 and x.dtype != FP8)
    ):
        raise ValueError(
            f"linear of x {tuple(x.shape)} {x.dtype} by W {tuple(weight.shape)} {weight.dtype}: "
            "W must be [N, K] of x's dtype, or float8_e4m3fn by float8 rows"
            + (" with N even (swiglu)" if swiglu else "")
        )
    if fp8 and (
        scale is None
        or x_scale is None
        or dtype is None
        or scale.shape != (weight.shape[0],)
        or x_scale.shape != (rows,)
        or scale.dtype != torch.float32
        or x_scale.dtype != torch.float32
    ):
        raise ValueError(
            f"linear by an fp8 W [{weight.shape[0]}, K] needs fp32 scales [{rows}] (x_scale) and "
            f"[{weight.shape[0]}] (scale), and the rows' dtype"
        )
    if not fp8 and (scale is not None or x_scale is not None or dtype not in (None, x.dtype)):
        raise ValueError(f"linear by a {weight.dtype} W takes no scales and rounds to its dtype")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("linear needs x and W with a contiguous last dimension")
    wanted = rows_wanted
    if wanted is not None and (wanted.shape != (rows,) or wanted.dtype != torch.bool):
        raise ValueError(f"linear's rows_wanted must be a [{rows}] bool mask")
    dtype = dtype or x.dtype
    out = torch.empty((rows, columns), dtype=out_dtype or dtype, device=x.device)
    if rows == 0:
        return out
    # fp32 rows (exactness runs) take fp32's tiling whatever W's dtype; an fp8 W one tiling at
    # every row count.
    if tiling is None and fp8 and dtype != torch.float32:
        tiling = fp8_tiling(rows, invariant=True, dots=fp8_dots(x.device))
    tile = tiling or tiling_for(rows, columns, dtype, swiglu)
    if tile.fp8_dot and (not fp8 or dtype == torch.float32):
        raise ValueError("an fp8_dot tiling multiplies fp8 rows by an fp8 W in 16-bit dtypes")
    grid = (triton.cdiv(columns, tile.block_n), triton.cdiv(rows, tile.block_m))
    masked = rows_wanted is not None
    _matmul_kernel[grid](
        x, weight, x if scale is None else scale, x if x_scale is None else x_scale, out,
        rows_wanted if masked else x, rows, columns, depth, x.stride(0), weight.stride(0),
        out.stride(0), IEEE=dtype == torch.float32,
        # triton 3.9's interpreter multiplies 16-bit dot operands as integer bit patterns; fp32
        # operands are exact for bf16 / fp16 / fp8 values.
        UPCAST=x.device.type == "cpu", EVEN_K=depth % tile.block_k == 0, MASKED=masked,
        SWIGLU=swiglu, SCALED=fp8, FP8_DOT=tile.fp8_dot, FP8_SUMS=tile.fp8_sums,
        DTYPE=triton_dtype(dtype),
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out


@triton.jit
def _gate_kernel(
    h_ptr, w_ptr, bias_ptr, out_ptr, size, stride_h, SIGMOID: tl.constexpr, BLOCK: tl.constexpr
):
    """One row: lane j sums h[j + i * BLOCK] * w[...] over i in order, then the lanes fold in
    `tl.sum`'s fixed tree, then the bias: an order that only BLOCK decides; then (SIGMOID) the
    logistic function, saving the step a launch."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < size
        h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        acc += h * tl.load(w_ptr + cols, mask=mask, other=0.0)
    logit = tl.sum(acc, axis=0) + tl.load(bias_ptr)
    tl.store(out_ptr + row, tl.sigmoid(logit) if SIGMOID else logit)


def gate_logit(
    hidden: torch.Tensor,  # [T, H], any float dtype (cast to fp32 exactly)
    weight: torch.Tensor,  # [1, H] fp32
    bias: torch.Tensor,  # [1] fp32
    sigmoid: bool = False,
) -> torch.Tensor:
    """hidden · w + b in fp32, [T, 1] (with `sigmoid`, its logistic function: the exit hazard);
    one program per row, so no row depends on another."""
    rows, size = hidden.shape
    if weight.shape != (1, size) or weight.dtype != torch.float32 or bias.shape != (1,):
        raise ValueError(f"gate_logit needs an fp32 [1, {size}] weight and a [1] bias")
    if hidden.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("gate_logit needs a contiguous last dimension")
    out = torch.empty((rows, 1), dtype=torch.float32, device=hidden.device)
    if rows:
        block = min(1024, triton.next_power_of_2(size))
        _gate_kernel[(rows,)](
            hidden, weight, bias, out, size, hidden.stride(0), SIGMOID=sigmoid, BLOCK=block
        )
    return out
