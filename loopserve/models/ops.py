"""The elementwise and row-wise operations of a layer, as torch ops or as fused Triton kernels.

Owns: `RMSNorm` (the weights a norm op reads), `TorchOps` (the reference math, used on CPU, in
training and wherever Triton is absent) and `TritonOps` (one launch per operation, for CUDA decode
steps, where kernel count dominates).
Must not: differ in math: both round to the model dtype at the same points (see
kernels/fused_ops.py); tests compare them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loopserve.models.quant import Linear, fp8_linear, scaled_mm, scaled_mm_fits, weight_scale


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, cast back, then scale (the HF order of operations).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class ModelOps(Protocol):
    # RoPE as `kernels.fused_ops.rotate_half` computes it, so a kernel that applies RoPE itself
    # (the Triton decode kernel) gives this op's bits.
    rotary_is_fused_ops: bool

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor: ...

    def add_norm(
        self,
        update: torch.Tensor,
        residual: torch.Tensor,
        update_norm: RMSNorm | None,
        out_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + update_norm(update), out_norm of that); without `update_norm` (a pre-norm
        layer) the update is added as it is."""
        ...

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        """x W^T of a layer's projection (bf16 or fp8 weights: `models.quant`'s rule)."""
        ...

    def swiglu(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        """silu_mul(gate, up) of x W^T = [gate, up]: the MLP's fused gate/up projection."""
        ...

    def down_proj(self, activated: torch.Tensor, layer: Linear) -> torch.Tensor:
        """activated W^T: the MLP's down projection."""
        ...

    def stage_linear(
        self,
        x: torch.Tensor,
        layer: Linear,
        rows: torch.Tensor | None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """x W^T (with `swiglu`, silu_mul of its halves) in a prelude or coda layer; `rows` [T]
        bool: the rows a decode step needs (a step where none is needed need read no weight)."""
        ...

    def exit_hazard(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """The exit gate's fp32 hazard sigmoid(h w^T + b) [T] of hidden [T, H] (any dtype; fp32
        weight and bias)."""
        ...

    def lm_head(
        self, hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """fp32 logits [T, V] of hidden [T, H] (rounded to the model dtype first); `rows` [T]
        bool: only those rows' logits are needed, the others are 0."""
        ...


class TorchOps:
    rotary_is_fused_ops = False

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_norm(
        self,
        update: torch.Tensor,
        residual: torch.Tensor,
        update_norm: RMSNorm | None,
        out_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + (update if update_norm is None else update_norm(update))
        return total, out_norm(total)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up

    def linear(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        scale = weight_scale(layer)
        return F.linear(x, layer.weight) if scale is None else fp8_linear(x, layer.weight, scale)

    def swiglu(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        gate, up = self.linear(x, layer).chunk(2, dim=-1)
        return self.silu_mul(gate, up)

    def down_proj(self, activated: torch.Tensor, layer: Linear) -> torch.Tensor:
        return self.linear(activated, layer)

    def stage_linear(
        self,
        x: torch.Tensor,
        layer: Linear,
        rows: torch.Tensor | None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """Every row (the rows not needed are computed and left unused)."""
        return self.swiglu(x, layer) if swiglu else self.linear(x, layer)

    def exit_hazard(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return torch.sigmoid(F.linear(hidden.float(), weight, bias)).squeeze(-1)

    def lm_head(
        self, hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor:
        logits = F.linear(hidden, weight).float()
        return logits if rows is None else torch.where(rows[:, None], logits, 0.0)


class TritonOps(TorchOps):
    """Fused kernels; q and k are rotated in place (they are views of a fresh projection). The
    exit gate is `kernels.matmul.gate_logit` with the sigmoid in it (one program a row: 1.9–4.0 µs
    on the H200 where cuBLAS's fp32 GEMV and the cast before it took 6.9–16.4, and a row's bits
    never depend on the row count; Triton's sigmoid is within an ulp or two of torch's, and the
    serial reference runs the same ops), and the LM head `kernels.matmul.linear`, which computes
    only the rows asked for (a decode step's exiting rows) and gives a row the same bits at every
    row count. The layer's weight matmuls are TorchOps's (cuBLAS) unless `batch_invariant`, except
    that at up to `SWIGLU_ROWS` bf16 rows the gate/up projection is `kernels.matmul.linear` with
    SiLU·up as its epilogue (one launch fewer a layer): its bits are cuBLAS's followed by
    `silu_mul`'s at every row count on the H200 for Ouro's shapes (tests/kernels/test_matmul.py;
    cuBLAS does not split that K), so a row's bits do not depend on which side of the threshold
    its batch falls.

    `batch_invariant`: the down projection runs as `kernels.matmul.linear`, whose rows have the
    same bits at every row count; cuBLAS (the default) changes its reduction order with the row
    count for some shapes (kernels/matmul.py says which).

    FP8 weights (`models.quant`: activations quantized per row, W8A8): at up to `GEMV_ROWS`
    16-bit rows `kernels.gemv.fp8_gemv`, which reads the weights at memory speed; past
    `SCALED_MM_ROWS` on Hopper, cuBLAS (`models.quant.scaled_mm`); in between, and wherever
    cuBLAS cannot (a row mask, fp16, older GPUs), `kernels.matmul.linear` (fp8 by fp8 on the
    tensor cores where the GPU can, `kernels.matmul.fp8_tiling`). These sum in different
    orders, so a request's bits depend on which side of those row counts its steps fall (as
    bf16's do past 64 rows under cuBLAS). `batch_invariant` keeps `linear` under one tiling at
    every row count, and so do fp32 rows (the exactness runs), under fp32's.
    With `quantize_inputs` (a model with fp8 weights) the norms (`rms_norm`, `add_norm`: what
    the qkv and gate/up projections read) and, past `SCALED_MM_ROWS`, SiLU·up after cuBLAS (what
    the down projection reads) also write their output quantized (`kernels.e4m3.store_quantized`)
    and tag the tensor they return with those rows (`E4M3_ROWS`), so the projection that reads it
    needs neither a `quantize_rows` launch nor the GEMV's pass for the row's scale. The rows are
    those `quantize_rows` would make, bit for bit, so the tag changes no result
    (tests/kernels/test_fused_ops.py). A norm whose output no projection reads (the loop's last,
    Huginn's after each residual add) writes them unread: an fp8 copy of the row, a small part of
    a kernel that reads two rows and writes two.
    """

    rotary_is_fused_ops = True
    # The gate/up projection with SiLU·up fused up to this many rows: 14.8–15.0 against 15.8–15.9
    # µs at 1, 4, 8 and 16 rows of Ouro-1.4B (docs/latency.md, "Norms and SiLU·up into the
    # matmuls"; 32 rows unmeasured).
    SWIGLU_ROWS = 16
    # fp8 weights through the GEMV up to the first, through cuBLAS's fp8 matmul past the second:
    # on an H100, with rows made by add_norm, summed over Ouro-1.4B's four projections, the GEMV
    # 32.1 / 38.5 µs at 1 / 2 rows against 40.8 / 40.4 for the fp8-dot matmul (its sums left
    # in fp8 then; at 16 rows that made no difference), which beats cuBLAS at 16 rows (40.5
    # against 52.5) and not at 128 (66.2 against 52.6; 32 to 64 unmeasured with its sums kept
    # in fp32) (docs/quantization.md, "Where it runs").
    GEMV_ROWS = 2
    SCALED_MM_ROWS = 16
    # The attribute by which a tensor carries its rows quantized (float8, fp32 scales): set on
    # what `rms_norm`, `add_norm` and SiLU·up after cuBLAS (`_triton_linear`) return, read by
    # `_triton_linear`; a view or copy does not carry it. The rule that keeps it true: no op
    # writes into a tensor it did not make (q and k are rotated in place, but they are a
    # projection's output, never tagged).
    E4M3_ROWS = "loopserve_e4m3_rows"

    def __init__(
        self,
        batch_invariant: bool = False,
        quantize_inputs: bool = False,
        dependent_launches: bool = False,
    ) -> None:
        from loopserve.kernels import fused_ops

        self._kernels = fused_ops
        self.batch_invariant = batch_invariant
        self.quantize_inputs = quantize_inputs
        self.dependent_launches = dependent_launches

    def _invariant(self, dtype: torch.dtype) -> bool:
        """Whether rows of `dtype` keep fp8 `linear` under one tiling at every row count:
        `batch_invariant`, and fp32 rows (the exactness runs)."""
        return self.batch_invariant or dtype == torch.float32

    def dependent_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows of `dtype` a layer's kernels are launched as programmatic
        dependents (`kernels.pdl`): with `dependent_launches` (fp8 weights on SM90+), where fp8
        rows go through the GEMV, so that a layer's kernels are all ours; 0: none. The attention
        spec's `dependent_launch_rows` passes the same to the decode kernel."""
        gemv = self.dependent_launches and not self._invariant(dtype)
        return self.GEMV_ROWS if gemv else 0

    def dependent(self, x: torch.Tensor) -> bool:
        """Whether the kernel of an op on rows `x` is launched as a programmatic dependent."""
        return x.shape[0] <= self.dependent_rows(x.dtype)

    def _tag(self, x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if rows is not None:
            setattr(x, self.E4M3_ROWS, rows)

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        out, rows = self._kernels.rms_norm(
            x, norm.weight, norm.eps, self.quantize_inputs, self.dependent(x)
        )
        self._tag(out, rows)
        return out

    def add_norm(
        self,
        update: torch.Tensor,
        residual: torch.Tensor,
        update_norm: RMSNorm | None,
        out_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if update_norm is not None and update_norm.eps != out_norm.eps:
            raise ValueError("fused add_norm needs both norms to share eps")
        update_weight = None if update_norm is None else update_norm.weight
        total, normed, rows = self._kernels.add_norm(
            update, residual, update_weight, out_norm.weight, out_norm.eps, self.quantize_inputs,
            self.dependent(update),
        )  # fmt: skip
        self._tag(normed, rows)
        return total, normed

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kernels.rotary_qk_(q, k, cos, sin)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._kernels.silu_mul(gate, up)

    def _triton_linear(
        self,
        x: torch.Tensor,
        layer: Linear,
        rows_wanted: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """`kernels.matmul.linear`; fp8 weights as the class docstring says."""
        from loopserve.kernels.matmul import fp8_dots, fp8_tiling, linear

        scale = weight_scale(layer)
        if scale is None:
            return linear(x, layer.weight, rows_wanted=rows_wanted, swiglu=swiglu)
        rows = x.shape[0]
        invariant = self._invariant(x.dtype)
        quantized: tuple[torch.Tensor, torch.Tensor] | None = getattr(x, self.E4M3_ROWS, None)
        if not invariant and rows <= self.GEMV_ROWS:
            from loopserve.kernels.gemv import fp8_gemv

            pdl = self.dependent(x)
            if quantized is None:  # the GEMV quantizes the row itself
                return fp8_gemv(x, layer.weight, scale, rows_wanted, swiglu=swiglu, pdl=pdl)
            x8, x_scale = quantized
            return fp8_gemv(x8, layer.weight, scale, rows_wanted, swiglu=swiglu,
                            x_scale=x_scale, dtype=x.dtype, pdl=pdl)  # fmt: skip
        from loopserve.kernels.e4m3 import quantize_rows

        x8, x_scale = quantized or quantize_rows(x)
        if (
            not invariant
            and rows > self.SCALED_MM_ROWS
            and rows_wanted is None
            and scaled_mm_fits(x, layer.weight)
        ):
            out = scaled_mm(x8, x_scale, layer.weight, scale)
            if not swiglu:
                return out
            gate, up = out.chunk(2, dim=-1)
            activated, rows8 = self._kernels.silu_mul_rows(gate, up, self.quantize_inputs)
            self._tag(activated, rows8)
            return activated
        dots = fp8_dots(x.device)
        tiling = None if x.dtype == torch.float32 else fp8_tiling(rows, invariant, dots)
        return linear(x8, layer.weight, tiling, rows_wanted, swiglu=swiglu, scale=scale,
                      x_scale=x_scale, dtype=x.dtype)  # fmt: skip

    def linear(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        if weight_scale(layer) is None:
            return super().linear(x, layer)
        return self._triton_linear(x, layer)

    def swiglu(self, x: torch.Tensor, layer: Linear) -> torch.Tensor:
        if weight_scale(layer) is None and (
            x.dtype != torch.bfloat16 or x.shape[0] > self.SWIGLU_ROWS
        ):
            return super().swiglu(x, layer)
        return self._triton_linear(x, layer, swiglu=True)

    def down_proj(self, activated: torch.Tensor, layer: Linear) -> torch.Tensor:
        if weight_scale(layer) is None and not self.batch_invariant:
            return super().down_proj(activated, layer)
        return self._triton_linear(activated, layer)

    def exit_hazard(
        self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        from loopserve.kernels.matmul import gate_logit

        return gate_logit(hidden, weight, bias, sigmoid=True).squeeze(-1)

    def stage_linear(
        self,
        x: torch.Tensor,
        layer: Linear,
        rows: torch.Tensor | None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """kernels/matmul.py's masked matmul, as the LM head's: a program whose rows are all
        unneeded stores zeros without reading its weights, and a row's bits do not depend on the
        mask or the row count (so the serial reference, unmasked, gets the engine's bits); fp8
        weights as `linear` says (the GEMV at few rows, masked alike)."""
        return self._triton_linear(x.contiguous(), layer, rows, swiglu)

    def lm_head(
        self, hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor | None
    ) -> torch.Tensor:
        from loopserve.kernels.matmul import linear

        return linear(hidden, weight, rows_wanted=rows, out_dtype=torch.float32)
