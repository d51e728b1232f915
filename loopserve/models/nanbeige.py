"""Nanbeige4.2 (`NanbeigeForCausalLM`): a Llama-shaped stack of pre-norm layers run `num_loops`
times with shared weights.

Owns: Nanbeige's part of the model math of docs/looped-models.md ("Nanbeige4.2"): the pre-norm
layer (GQA attention, SwiGLU) and whether the final norm ends every loop. The stages are
`models.looped`'s; Nanbeige has no exit gate (its tokens run every loop unless a trace or a
per-request depth says otherwise). Must not: know about KV pages, batching or requests.
"""

from __future__ import annotations

import torch
from torch import nn

from loopserve.models.layers import MLP, Attention, LoopContext
from loopserve.models.looped import LoopedBody, LoopedForCausalLM
from loopserve.models.nanbeige_config import NanbeigeConfig
from loopserve.models.ops import ModelOps, RMSNorm


class NanbeigeDecoderLayer(nn.Module):
    """h = x + Attn(N1(x)); y = h + MLP(N2(h))."""

    def __init__(self, config: NanbeigeConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        x_normed: torch.Tensor,
        next_norm: RMSNorm,
        ctx: LoopContext,
        ops: ModelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, N1(x)) -> (y, next_norm(y))."""
        attended = self.self_attn(x_normed, self.layer_index, ctx, ops)
        h, h_normed = ops.add_norm(attended, x, None, self.post_attention_layernorm)
        return ops.add_norm(self.mlp(h_normed, ops), h, None, next_norm)


class NanbeigeBody(LoopedBody):
    """`model.*` in the HF checkpoint: embedding, the shared layers, final norm."""

    def __init__(self, config: NanbeigeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            NanbeigeDecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class NanbeigeForCausalLM(LoopedForCausalLM):
    """Nanbeige4.2: the staged interface, no exit gate."""

    def __init__(self, config: NanbeigeConfig) -> None:
        super().__init__(config, NanbeigeBody(config))
        self.skips_loop_norm = config.skip_loop_final_norm
