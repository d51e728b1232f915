"""The pieces of a layer that every looped family builds from: attention, SwiGLU MLP, rotary angles.

Owns: `LoopContext` (what one pass through a stack needs besides the hidden state), rotate-half
RoPE angles in fp32, self-attention with separate or fused q/k/v projections, and the SwiGLU MLP
with separate or fused gate/up projections. Must not: know about KV pages, batching or requests,
or how a family arranges its norms (each family's decoder layer does).
Attention is whatever `LoopContext.attention` does; the caller decides which KV a query sees.

Shapes: T = tokens in the pass, H = hidden size, Nq/Nkv = query/KV heads, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from loopserve.models.model_config import LoopedConfig
from loopserve.models.ops import ModelOps
from loopserve.models.quant import Linear, fused_linear

# (layer index, q [T, Nq, D], k [T, Nkv, D], v [T, Nkv, D]) -> attention output [T, Nq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LoopContext:
    """What one pass through the shared stack needs besides the hidden state."""

    cos: torch.Tensor  # [T, D] rotary cosines of the tokens' positions (model dtype)
    sin: torch.Tensor  # [T, D]
    attention: AttentionFn
    attention_rotates: bool = False  # attention applies RoPE to q and k itself (same bits)


class RotaryEmbedding:
    """Rotate-half RoPE; inverse frequencies and angles stay fp32 whatever the model dtype.

    Not an nn.Module on purpose: `model.to(dtype)` must never cast the frequencies.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self._inv_freq = 1.0 / (theta**exponents)  # [D/2] fp32, on the CPU until first use

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    """Self-attention with separate q/k/v projections (as in the checkpoint) or, after
    `fuse_projections`, one qkv projection (one matmul instead of three). Every projection runs
    through `ModelOps.linear` (bf16 or fp8 weights, `models.quant`)."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj: Linear | None = nn.Linear(hidden, self.q_size, bias=False)
        self.k_proj: Linear | None = nn.Linear(hidden, self.kv_size, bias=False)
        self.v_proj: Linear | None = nn.Linear(hidden, self.kv_size, bias=False)
        self.qkv_proj: Linear | None = None
        self.o_proj: Linear = nn.Linear(self.q_size, hidden, bias=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def fuse_projections(self) -> None:
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        self.qkv_proj = fused_linear([self.q_proj, self.k_proj, self.v_proj])
        self.q_proj = self.k_proj = self.v_proj = None

    def _project(
        self, x: torch.Tensor, ops: ModelOps
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, Nq, D], k/v [T, Nkv, D] (views of one matmul when fused)."""
        tokens = x.shape[0]
        if self.qkv_proj is not None:
            qkv = ops.linear(x, self.qkv_proj)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = (ops.linear(x, proj) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return (
            q.view(tokens, self.num_heads, self.head_dim),
            k.view(tokens, self.num_kv_heads, self.head_dim),
            v.view(tokens, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self, x: torch.Tensor, layer_index: int, ctx: LoopContext, ops: ModelOps
    ) -> torch.Tensor:
        q, k, v = self._project(x, ops)
        if not ctx.attention_rotates:
            q, k = ops.rotary(q, k, ctx.cos, ctx.sin)
        out = ctx.attention(layer_index, q, k, v)  # [T, Nq, D]
        return ops.linear(out.reshape(x.shape[0], self.q_size), self.o_proj)


class MLP(nn.Module):
    """SwiGLU; gate and up become one matmul after `fuse_projections`."""

    def __init__(self, config: LoopedConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj: Linear | None = nn.Linear(hidden, inner, bias=False)
        self.up_proj: Linear | None = nn.Linear(hidden, inner, bias=False)
        self.gate_up_proj: Linear | None = None
        self.down_proj: Linear = nn.Linear(inner, hidden, bias=False)

    def fuse_projections(self) -> None:
        assert self.gate_proj is not None and self.up_proj is not None
        self.gate_up_proj = fused_linear([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        if self.gate_up_proj is not None:
            activated = ops.swiglu(x, self.gate_up_proj)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            activated = ops.silu_mul(ops.linear(x, self.gate_proj), ops.linear(x, self.up_proj))
        return ops.down_proj(activated, self.down_proj)
