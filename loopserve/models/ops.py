"""The elementwise and row-wise operations of a layer, as torch ops or as fused Triton kernels.

Owns: `TorchOps` (the reference math, used on CPU, in training and wherever Triton is absent) and
`TritonOps` (one launch per operation, for CUDA decode steps, where kernel count dominates).
Must not: differ in math: both round to the model dtype at the same points (see
kernels/fused_ops.py); tests compare them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from loopserve.models.ouro import RMSNorm


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
        self, update: torch.Tensor, residual: torch.Tensor, update_norm: RMSNorm, out_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + update_norm(update), out_norm of that)."""
        ...

    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    rotary_is_fused_ops = False

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

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class TritonOps:
    """Fused kernels; q and k are rotated in place (they are views of a fresh projection)."""

    rotary_is_fused_ops = True

    def __init__(self) -> None:
        from loopserve.kernels import fused_ops

        self._kernels = fused_ops

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

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._kernels.silu_mul(gate, up)
