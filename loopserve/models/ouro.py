"""The Ouro looped transformer: one shared stack of sandwich-norm layers run several times a token.

Owns: Ouro's part of the model math of docs/looped-models.md ("Ouro"): the sandwich-norm layer,
the body with its fp32 exit gate, and the gate's hazard. The stages around them (embedding, one
loop ending in the final norm, the LM head) are `models.looped`'s. Must not: know about KV pages,
batching or requests.
"""

from __future__ import annotations

import torch
from torch import nn

from loopserve.models.layers import MLP, Attention, LoopContext
from loopserve.models.looped import LoopedBody, LoopedForCausalLM
from loopserve.models.ops import ModelOps, RMSNorm
from loopserve.models.ouro_config import OuroConfig


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
        """(x, N1(x)) -> (y, next_norm(y))."""
        attended = self.self_attn(x_normed, self.layer_index, ctx, ops)
        h, h_normed = ops.add_norm(
            attended, x, self.input_layernorm_2, self.post_attention_layernorm
        )
        return ops.add_norm(self.mlp(h_normed, ops), h, self.post_attention_layernorm_2, next_norm)


class OuroBody(LoopedBody):
    """`model.*` in the HF checkpoint: embedding, the shared layers, final norm, exit gate."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)


class OuroForCausalLM(LoopedForCausalLM):
    """Ouro: the staged interface with the gate's hazard after every loop."""

    model: OuroBody

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config, OuroBody(config))
        # The exit gate's weight and bias in fp32, made once for inference (`fuse_projections`).
        self._gate_fp32: tuple[torch.Tensor, torch.Tensor] | None = None

    def fuse_projections(self) -> None:
        """As `LoopedForCausalLM`'s, and the exit gate keeps fp32 copies of its weights (two casts
        less per step in bf16; the same values the casts would give)."""
        super().fuse_projections()
        gate = self.model.early_exit_gate
        self._gate_fp32 = (gate.weight.detach().float(), gate.bias.detach().float())

    def exit_probability(
        self, hidden: torch.Tensor, previous: torch.Tensor, threshold: torch.Tensor | float
    ) -> torch.Tensor:
        """The per-loop exit hazard λ = sigmoid(gate(h)) in fp32. hidden [T, H] -> [T] (the gate
        reads only this loop's output)."""
        gate = self.model.early_exit_gate
        weight, bias = self._gate_fp32 or (gate.weight.float(), gate.bias.float())
        return self.ops.exit_hazard(hidden, weight, bias)
