"""The operations of a layer, as torch ops or as fused Triton kernels: norms, RoPE, SiLU·up
and the four weight projections.

Owns: `TorchOps` (the reference math, used on CPU, in training and wherever Triton is absent),
`TritonOps` (one launch per operation, for CUDA decode steps, where kernel count dominates) and
`GEMV_MAX_ROWS`, which says when `TritonOps` runs a projection with the Triton matmul of
kernels/gemv.py instead of cuBLAS. Must not: differ in math: both round to the model dtype at the
same points (see kernels/fused_ops.py); tests compare them. The projections' fp32 sums are
ordered differently by cuBLAS and by kernels/gemv.py (each fixed for a given path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from loopserve.models.ouro import RMSNorm

Projection = Literal["qkv", "o", "gate_up", "down"]

# The largest row count M at which `TritonOps` runs each projection with the Triton matmul of
# kernels/gemv.py (bf16/fp16 weights only; above it, and for fp32, cuBLAS via F.linear). From
# `python -m loopserve.bench.gemv` on the H200 (which of cuBLAS and Triton wins per projection
# and M). PROVISIONAL: M <= 8 everywhere until that run. A row's bits differ between the two
# paths, so bf16 batch invariance holds only among row counts on the same side of a threshold.
GEMV_MAX_ROWS: dict[Projection, int] = {"qkv": 8, "o": 8, "gate_up": 8, "down": 8}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class ModelOps(Protocol):
    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor: ...

    def add_norm(
        self, update: torch.Tensor, residual: torch.Tensor, update_norm: RMSNorm, out_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + update_norm(update), out_norm of that)."""
        ...

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def linear(self, x: torch.Tensor, module: nn.Linear, projection: Projection) -> torch.Tensor:
        """module(x) for x [T, in] -> [T, out]."""
        ...

    def down(self, gate: torch.Tensor, up: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        """module(silu(gate) * up): the MLP's down projection of its gate and up [T, I]."""
        ...


class TorchOps:
    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_norm(
        self, update: torch.Tensor, residual: torch.Tensor, update_norm: RMSNorm, out_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + update_norm(update)
        return total, out_norm(total)

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def linear(self, x: torch.Tensor, module: nn.Linear, projection: Projection) -> torch.Tensor:
        return module(x)

    def down(self, gate: torch.Tensor, up: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        return module(F.silu(gate) * up)


class TritonOps:
    """Fused kernels; q and k are rotated in place (they are views of a fresh projection).
    Projections of at most `GEMV_MAX_ROWS` rows run kernels/gemv.py (the down projection with
    SiLU·up in the same launch), others cuBLAS (after the SiLU·up kernel)."""

    def __init__(self) -> None:
        from loopserve.kernels import fused_ops, gemv

        self._kernels = fused_ops
        self._gemv = gemv

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return self._kernels.rms_norm(x, norm.weight, norm.eps)

    def add_norm(
        self, update: torch.Tensor, residual: torch.Tensor, update_norm: RMSNorm, out_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if update_norm.eps != out_norm.eps:
            raise ValueError("fused add_norm needs both norms to share eps")
        return self._kernels.add_norm(
            update, residual, update_norm.weight, out_norm.weight, update_norm.eps
        )

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kernels.rotary_qk_(q, k, cos, sin)

    def linear(self, x: torch.Tensor, module: nn.Linear, projection: Projection) -> torch.Tensor:
        if _gemv_fits(x, module, projection):
            return self._gemv.linear(x, module.weight)
        return F.linear(x, module.weight, module.bias)

    def down(self, gate: torch.Tensor, up: torch.Tensor, module: nn.Linear) -> torch.Tensor:
        if _gemv_fits(gate, module, "down") and up.stride(-1) == 1:
            return self._gemv.silu_linear(gate, up, module.weight)
        return F.linear(self._kernels.silu_mul(gate, up), module.weight, module.bias)


def _gemv_fits(x: torch.Tensor, module: nn.Linear, projection: Projection) -> bool:
    """Whether kernels/gemv.py runs this projection: few rows, bf16/fp16, no bias."""
    return (
        0 < x.shape[0] <= GEMV_MAX_ROWS[projection]
        and x.dtype in (torch.bfloat16, torch.float16)
        and module.weight.dtype == x.dtype
        and module.bias is None
        and x.stride(-1) == 1
    )
