"""The Ouro looped transformer: one shared stack of layers run several times per token.

Owns: the model math of docs/looped-models.md §1 (sandwich-norm layers, RoPE, the final norm that
ends every loop, the fp32 exit gate, the LM head). Must not: know about KV pages, batching or
requests.
Attention is whatever `LoopContext.attention` does; the caller decides which KV a query sees.

Shapes: T = tokens in the pass, H = hidden size, Nq/Nkv = query/KV heads, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from loopserve.models.ops import ModelOps, RMSNorm, TorchOps
from loopserve.models.ouro_config import OuroConfig

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
    `fuse_projections`, one qkv projection (one matmul instead of three)."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj: nn.Linear | None = nn.Linear(hidden, self.q_size, bias=False)
        self.k_proj: nn.Linear | None = nn.Linear(hidden, self.kv_size, bias=False)
        self.v_proj: nn.Linear | None = nn.Linear(hidden, self.kv_size, bias=False)
        self.qkv_proj: nn.Linear | None = None
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def fuse_projections(self) -> None:
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
        self.q_proj = self.k_proj = self.v_proj = None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, Nq, D], k/v [T, Nkv, D] (views of one matmul when fused)."""
        tokens = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        else:
            assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (
            q.view(tokens, self.num_heads, self.head_dim),
            k.view(tokens, self.num_kv_heads, self.head_dim),
            v.view(tokens, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self, x: torch.Tensor, layer_index: int, ctx: LoopContext, ops: ModelOps
    ) -> torch.Tensor:
        q, k, v = self._project(x)
        if not ctx.attention_rotates:
            q, k = ops.rotary(q, k, ctx.cos, ctx.sin)
        out = ctx.attention(layer_index, q, k, v)  # [T, Nq, D]
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    """SwiGLU; gate and up become one matmul after `fuse_projections`."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj: nn.Linear | None = nn.Linear(hidden, inner, bias=False)
        self.up_proj: nn.Linear | None = nn.Linear(hidden, inner, bias=False)
        self.gate_up_proj: nn.Linear | None = None
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def fuse_projections(self) -> None:
        assert self.gate_proj is not None and self.up_proj is not None
        self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
        self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor, ops: ModelOps) -> torch.Tensor:
        if self.gate_up_proj is not None:
            activated = ops.swiglu(x, self.gate_up_proj.weight)
        else:
            assert self.gate_proj is not None and self.up_proj is not None
            activated = ops.silu_mul(self.gate_proj(x), self.up_proj(x))
        return ops.down_proj(activated, self.down_proj.weight)


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One bias-free linear whose output is the parts' outputs side by side."""
    weight = torch.cat([part.weight for part in parts], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


class DecoderLayer(nn.Module):
    """h = x + N2(Attn(N1(x))); y = h + N4(MLP(N3(h)))."""

    def __init__(self, config: OuroConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        eps = config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        x_normed: torch.Tensor,
        next_norm: RMSNorm,
        ctx: LoopContext,
        ops: ModelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, N1(x)) -> (y, next_norm(y)). The norm that follows a residual add is fused with
        it: the next layer's N1, or the final norm after the last layer."""
        attended = self.self_attn(x_normed, self.layer_index, ctx, ops)
        h, h_normed = ops.add_norm(
            attended, x, self.input_layernorm_2, self.post_attention_layernorm
        )
        return ops.add_norm(self.mlp(h_normed, ops), h, self.post_attention_layernorm_2, next_norm)


class OuroBody(nn.Module):
    """`model.*` in the HF checkpoint: embedding, the shared layers, final norm, exit gate."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)


class OuroForCausalLM(nn.Module):
    """The whole model, split into the pieces a looped engine schedules separately.

    prelude: `embed`; one loop: `run_loop`; after a loop: `exit_probability` (gate) and
    `compute_logits` (coda). The same `positions` (RoPE phase) are used in every loop.
    """

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OuroBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # How norms, RoPE and SiLU run: torch ops, or fused kernels (set by the runner on CUDA).
        self.ops: ModelOps = TorchOps()
        # The exit gate's weight and bias in fp32, made once for inference (`fuse_projections`).
        self._gate_fp32: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse_projections(self) -> None:
        """Inference, after the weights are loaded and placed: q/k/v and gate/up each become one
        matmul (frees the separate weights), and the exit gate keeps fp32 copies of its weights
        (two casts less per step in bf16; the same values the casts would give)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        gate = self.model.early_exit_gate
        self._gate_fp32 = (gate.weight.detach().float(), gate.bias.detach().float())

    @property
    def layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.model.layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> hidden [T, H]."""
        return self.model.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, D]; computed once and shared by all loops."""
        return self.rotary(positions, self.dtype)

    def run_loop(self, hidden: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """One loop: every layer, then the final norm. hidden [T, H] -> normalised [T, H]."""
        layers = self.layers
        normed = self.ops.rms_norm(hidden, layers[0].input_layernorm)
        for index, layer in enumerate(layers):
            last = index + 1 == len(layers)
            next_norm = self.model.norm if last else layers[index + 1].input_layernorm
            hidden, normed = layer(hidden, normed, next_norm, ctx, self.ops)
        return normed

    def exit_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """The per-loop exit hazard λ = sigmoid(gate(h)) in fp32. hidden [T, H] -> [T]."""
        gate = self.model.early_exit_gate
        weight, bias = self._gate_fp32 or (gate.weight.float(), gate.bias.float())
        return self.ops.exit_hazard(hidden, weight, bias)

    def compute_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """hidden [T, H] -> fp32 logits [T, V]; `rows` [T] bool: only those rows' are needed (the
        others are 0, and the fused ops skip their work)."""
        return self.ops.lm_head(hidden, self.lm_head.weight, rows)
