"""The staged model interface every looped family implements, and what the families share of it.

Owns: `LoopedForCausalLM`, the model as the engine, the runner, the kernels and the reference
drive it, one stage at a time (docs/looped-models.md §1):
- `start` — the prelude: token ids -> the recurrent block's first input (once per token; the
  embedding for Ouro and Nanbeige, prelude layers and a seeded initial state for Huginn);
- `run_loop` — one pass of the recurrent block over the tokens of a pass, ending in what the next
  loop reads (Ouro, Nanbeige: the layers, then the final norm unless the family skips it);
- `exit_probability` — the family's exit hazard of a loop's output (fp32; 0 without an exit rule);
- `compute_logits` — the coda and LM head, for tokens that exit after any loop.
What a loop reads and returns is `carried_size` wide (the hidden size, or more where a family
carries more than its state between loops). The same `positions` (RoPE phase) are used in every
loop. Prelude and coda layers with attention (`has_stage_layers`) are handed their own
`LoopContext`; their K/V layers are numbered after the block's (`num_kv_layers` in all). Must
not: know about KV pages, batching or requests; a family's own layers and weights live in its
module.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
from torch import nn

from loopserve.models.layers import MLP, Attention, LoopContext, RotaryEmbedding
from loopserve.models.model_config import LoopedConfig
from loopserve.models.ops import ModelOps, RMSNorm, TorchOps

# The state seed of prompt tokens (families whose state starts random): a prompt's K/V are then a
# function of its tokens alone, so prefix caching stays exact; generated tokens use their
# request's seed.
PROMPT_STATE_SEED = 0


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
    # Prelude or coda layers with attention (their own K/V, one plane): `start` and
    # `compute_logits` then need a `LoopContext`.
    has_stage_layers = False
    # The exit criterion the engine runs (`LoopedConfig.resolve_exit_criterion`; set at load).
    exit_criterion = ""

    def __init__(self, config: LoopedConfig, body: LoopedBody | None = None) -> None:
        """`body`: the `model.*` module of families laid out like Ouro; a family laid out
        otherwise passes None and builds its own modules and LM head."""
        super().__init__()
        self.config = config
        if body is not None:
            self.model = body
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.tie_weights()
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        # How norms, RoPE and SiLU run: torch ops, or fused kernels (set by the runner on CUDA).
        self.ops: ModelOps = TorchOps()

    def tie_weights(self) -> None:
        """The LM head shares the embedding table when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def carried_size(self) -> int:
        """Width of what one loop reads and returns."""
        return self.config.hidden_size

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep K/V: the block's first (0 .. num_hidden_layers - 1), then any
        prelude and coda layers."""
        return self.config.num_hidden_layers

    @property
    def fused_bookkeeping(self) -> bool:
        """Whether the CUDA decode step's fused prologue and coda (which embed a token by a
        table lookup and carry `hidden_size` values) can run this family."""
        return not self.has_stage_layers and self.carried_size == self.config.hidden_size

    def parameter_stage(self, name: str) -> str | None:
        """How often decoding reads a parameter's whole tensor (the bandwidth floor's sizes):
        "loop" (every loop), "token" (once per generated token: the readout, and any prelude
        layers) or None (a table it only gathers rows of)."""
        if name.startswith("model.layers.") or name == "model.norm.weight":
            return "loop"
        return "token" if name == "lm_head.weight" else None

    def load_transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor as this model stores it (the identity unless a family re-lays
        some weights out at load)."""
        return tensor

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
        """The token embedding: input_ids [T] -> [T, H]."""
        return self.model.embed_tokens(input_ids)

    def start(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seeds: torch.Tensor,
        ctx: LoopContext | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prelude: input_ids [T] (at `positions` [T], with the state seeds [T] of a family
        whose state starts random) -> the block's first input [T, carried_size]; `ctx` is the
        prelude layers' attention (families with `has_stage_layers`); `rows` [T] bool: the rows
        whose output is used (prelude layers may skip the others' work; None: all)."""
        return self.embed(input_ids)

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

    def exit_probability(
        self, hidden: torch.Tensor, previous: torch.Tensor, threshold: torch.Tensor | float
    ) -> torch.Tensor:
        """The per-loop exit hazard λ in fp32 [T] of a loop's output `hidden` [T, carried]
        (`previous`: what that loop read; `threshold` [T] or one value: the request's exit
        threshold, which a convergence rule compares with); a family without an exit rule never
        exits on its own (λ = 0)."""
        return torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)

    @property
    def exit_needs_readout(self) -> bool:
        """Whether the exit criterion reads each loop's logits (`readout_exit`) rather than its
        output (`exit_probability`): the criteria that carry a memory between loops do."""
        return self.exit_memory_size > 0

    @property
    def exit_memory_size(self) -> int:
        """fp32 values per token that `readout_exit` carries from one loop to the next."""
        return 0

    def initial_exit_memory(self, rows: int) -> torch.Tensor:
        """`readout_exit`'s memory before a token's first loop, [rows, exit_memory_size]."""
        return torch.zeros((rows, self.exit_memory_size), device=self.device)

    def readout_exit(
        self, logits: torch.Tensor, memory: torch.Tensor, threshold: torch.Tensor | float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hazard λ [T] of a loop from its fp32 logits [T, V] and the previous loop's memory
        [T, exit_memory_size] -> (λ, this loop's memory), for a criterion that reads logits."""
        raise NotImplementedError(f"{self.exit_criterion!r} reads no logits")

    def compute_logits(
        self,
        hidden: torch.Tensor,
        rows: torch.Tensor | None = None,
        ctx: LoopContext | None = None,
    ) -> torch.Tensor:
        """The exit readout: a loop's output [T, carried] -> fp32 logits [T, V]; `rows` [T] bool:
        only those rows' are needed (the others are 0, and the fused ops skip their work); `ctx`
        is the coda layers' attention (families with `has_stage_layers`)."""
        return self.head(self.coda(hidden, ctx, rows), rows)

    def coda(
        self,
        hidden: torch.Tensor,
        ctx: LoopContext | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A loop's output [T, carried] -> the LM head's input [T, H]: the final norm where the
        loops skip it, else nothing (a family with coda layers runs them here, only for `rows`
        where a decode step gives them)."""
        return self.ops.rms_norm(hidden, self.model.norm) if self.skips_loop_norm else hidden

    def head(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head: [T, H] -> fp32 logits [T, V] (`rows` as in `compute_logits`)."""
        return self.ops.lm_head(hidden, self.lm_head.weight, rows)
