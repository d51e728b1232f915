"""The staged model interface every looped family implements, and what the families share of it.

Owns: `LoopedForCausalLM`, the model as the engine, the runner, the kernels and the reference
drive it, one stage at a time (docs/looped-models.md §1):
- `embed` — the prelude: token ids -> the recurrent block's first input (once per token);
- `run_loop` — one pass of the recurrent block over the tokens of a pass, ending in what the next
  loop reads (every family here: the layers, then the final norm unless the family skips it);
- `exit_probability` — the family's exit hazard of a loop's output (fp32; 0 without a gate);
- `compute_logits` — the coda and LM head, for tokens that exit after any loop.
The same `positions` (RoPE phase) are used in every loop. Must not: know about KV pages, batching
or requests; a family's own layers and weights live in its module.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from loopserve.models.layers import MLP, Attention, LoopContext, RotaryEmbedding
from loopserve.models.model_config import LoopedConfig
from loopserve.models.ops import ModelOps, RMSNorm, TorchOps


class BlockLayer(Protocol):
    """A layer of the recurrent block; `input_layernorm` is the norm its input gets first."""

    input_layernorm: RMSNorm
    self_attn: Attention
    mlp: MLP

    def __call__(
        self,
        x: torch.Tensor,
        x_normed: torch.Tensor,
        next_norm: RMSNorm,
        ctx: LoopContext,
        ops: ModelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, input_layernorm(x)) -> (y, next_norm(y))."""
        ...


class LoopedBody(nn.Module):
    """`model.*` in an HF checkpoint: the embedding, the block's layers and the final norm (a
    family's body adds its own parts)."""

    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: RMSNorm


class LoopedForCausalLM(nn.Module):
    """A looped model split into the stages a looped engine schedules separately."""

    config: LoopedConfig
    model: LoopedBody
    # False: the final norm ends every loop; True: only the exit readout is normed.
    skips_loop_norm = False

    def __init__(self, config: LoopedConfig, body: LoopedBody) -> None:
        super().__init__()
        self.config = config
        self.model = body
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # How norms, RoPE and SiLU run: torch ops, or fused kernels (set by the runner on CUDA).
        self.ops: ModelOps = TorchOps()

    def fuse_projections(self) -> None:
        """Inference, after the weights are loaded and placed: q/k/v and gate/up each become one
        matmul (frees the separate weights)."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    @property
    def layers(self) -> list[BlockLayer]:
        return cast(list[BlockLayer], list(self.model.layers))

    @property
    def embedding(self) -> torch.Tensor:
        """The token embedding table [V, H] (the fused decode prologue reads it)."""
        return self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prelude: input_ids [T] -> the block's first input [T, H]."""
        return self.model.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, D]; computed once and shared by all loops."""
        return self.rotary(positions, self.dtype)

    def run_loop(self, hidden: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """One loop: every layer, then the final norm (unless the family skips it between loops).
        hidden [T, H] -> what the next loop reads [T, H]. The norm that follows a residual add is
        fused with it: the next layer's input norm, or the final norm after the last layer."""
        layers = self.layers
        normed = self.ops.rms_norm(hidden, layers[0].input_layernorm)
        for index, layer in enumerate(layers):
            last = index + 1 == len(layers)
            next_norm = self.model.norm if last else layers[index + 1].input_layernorm
            hidden, normed = layer(hidden, normed, next_norm, ctx, self.ops)
        return hidden if self.skips_loop_norm else normed

    def exit_probability(self, hidden: torch.Tensor) -> torch.Tensor:
        """The per-loop exit hazard λ in fp32 [T] of a loop's output [T, H]; a family without an
        exit gate never exits on its own (λ = 0)."""
        return torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)

    def compute_logits(
        self, hidden: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The exit readout: a loop's output [T, H] -> fp32 logits [T, V]; `rows` [T] bool: only
        those rows' are needed (the others are 0, and the fused ops skip their work)."""
        if self.skips_loop_norm:
            hidden = self.ops.rms_norm(hidden, self.model.norm)
        return self.ops.lm_head(hidden, self.lm_head.weight, rows)
