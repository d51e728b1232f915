"""The Ouro looped transformer: one shared stack of layers run several times per token.

Owns: the model math of ARCHITECTURE.md §1 (sandwich-norm layers, RoPE, the final norm that ends
every loop, the fp32 exit gate, the LM head). Must not: know about KV pages, batching or requests.
Attention is whatever `LoopContext.attention` does; the caller decides which KV a query sees.

Shapes: T = tokens in the pass, H = hidden size, Nq/Nkv = query/KV heads, D = head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loopserve.models.ouro_config import OuroConfig

# (layer index, q [T, Nq, D], k [T, Nkv, D], v [T, Nkv, D]) -> attention output [T, Nq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class LoopContext:
    """What one pass through the shared stack needs besides the hidden state."""

    cos: torch.Tensor  # [T, D] rotary cosines of the tokens' positions (model dtype)
    sin: torch.Tensor  # [T, D]
    attention: AttentionFn


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, layer_index: int, ctx: LoopContext) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, ctx.cos, ctx.sin)
        k = apply_rotary(k, ctx.cos, ctx.sin)
        out = ctx.attention(layer_index, q, k, v)  # [T, Nq, D]
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), self.layer_index, ctx)
        h = x + self.input_layernorm_2(attended)
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


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
        for layer in self.model.layers:
            hidden = layer(hidden, ctx)
        return self.model.norm(hidden)

    def exit_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """The per-loop exit hazard λ = sigmoid(gate(h)) in fp32. hidden [T, H] -> [T]."""
        gate = self.model.early_exit_gate
        logit = F.linear(hidden.float(), gate.weight.float(), gate.bias.float())
        return torch.sigmoid(logit).squeeze(-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> fp32 logits [T, V]."""
        return self.lm_head(hidden).float()
