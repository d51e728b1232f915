"""Huginn-0125 (`RavenForCausalLM`): a prelude run once, a recurrent block run r times on a state
that starts random, a coda run once at the exit.

Owns: Huginn's part of the model math of docs/looped-models.md ("Huginn-0125"): the sandwich
layer with post-add norms, attention with one Wqkv projection and a QK bias, the scaled embedding
and the prelude, the seeded truncated-normal initial state, the adapter that injects the
prelude's output into every loop, the coda between two applications of `ln_f`, and the
convergence exit rule (latent-diff). The module tree is the checkpoint's (`transformer.*`).
Must not: know about KV pages, batching or requests.

What one loop reads and returns is [state, e] side by side (`carried_size` = 2 x n_embd): the
state s and the prelude's output e, which every loop re-reads (input injection). Checkpoints
rotate adjacent pairs of a head's q/k dimensions; `load_transform` reorders those dimensions
(evens, then odds) so that the shared rotate-half RoPE, and every attention backend, compute the
same scores (q . k is unchanged when q and k are permuted alike).
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn

from loopserve.models.huginn_config import HuginnConfig
from loopserve.models.layers import LoopContext
from loopserve.models.looped import LoopedForCausalLM
from loopserve.models.ops import ModelOps, RMSNorm
from loopserve.models.quant import Linear
from loopserve.sample.noise import uniform_noise

# Initial states are drawn from their own stream of the counter-based noise: the request's seed
# with this bit flipped, counted by position (sampling counts by output index).
STATE_STREAM = 1 << 62
# Φ(±3): the truncated normal's bounds as probabilities.
_LOW, _HIGH = 0.5 * math.erfc(3 / math.sqrt(2)), 0.5 * math.erfc(-3 / math.sqrt(2))


def _linear(
    x: torch.Tensor,
    layer: Linear,
    ops: ModelOps,
    stage: bool,
    rows: torch.Tensor | None,
    swiglu: bool = False,
) -> torch.Tensor:
    """A projection of a block layer (every row, cuBLAS) or of a prelude / coda layer (only the
    rows a decode step needs, `ModelOps.stage_linear`)."""
    if stage:
        return ops.stage_linear(x, layer, rows, swiglu)
    return ops.swiglu(x, layer) if swiglu else ops.linear(x, layer)


class HuginnAttention(nn.Module):
    """q, k, v = Wqkv(x) (every head its own K/V); q and k get the QK bias, then RoPE."""

    def __init__(self, config: HuginnConfig, stage: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.stage = stage
        hidden = config.hidden_size
        self.Wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.qk_bias = (
            nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim))
            if config.qk_bias
            else None
        )
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        layer_index: int,
        ctx: LoopContext,
        ops: ModelOps,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        shape = (tokens, self.num_heads, self.head_dim)
        qkv = _linear(x, self.Wqkv, ops, self.stage, rows)
        qk, v = qkv[:, : 2 * x.shape[1]], qkv[:, 2 * x.shape[1] :]
        if self.qk_bias is not None:  # [q, k] of a token stay side by side, as fused RoPE wants
            qk = qk + self.qk_bias.reshape(-1)
        q, k = (part.view(shape) for part in qk.chunk(2, dim=-1))
        v = v.view(shape)
        if not ctx.attention_rotates:
            q, k = ops.rotary(q, k, ctx.cos, ctx.sin)
        out = ctx.attention(layer_index, q, k, v)  # [T, heads, D]
        return _linear(out.reshape(tokens, -1), self.proj, ops, self.stage, rows)


class GatedMLP(nn.Module):
    """proj(silu(a) * b) with [a, b] = fc(x)."""

    def __init__(self, config: HuginnConfig, stage: bool) -> None:
        super().__init__()
        self.stage = stage
        self.fc = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, ops: ModelOps, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        activated = _linear(x, self.fc, ops, self.stage, rows, swiglu=True)
        if not self.stage:
            return ops.down_proj(activated, self.proj)
        return ops.stage_linear(activated, self.proj, rows)


class SandwichBlock(nn.Module):
    """h = N2(x + Attn(N1(x))); y = N4(h + MLP(N3(h))). `stage`: a prelude or coda layer, whose
    projections take the rows a decode step needs (`rows`)."""

    def __init__(self, config: HuginnConfig, stage: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        hidden = config.hidden_size
        self.norm_1 = RMSNorm(hidden, eps)
        self.attn = HuginnAttention(config, stage)
        self.norm_2 = RMSNorm(hidden, eps)
        self.mlp = GatedMLP(config, stage)
        self.norm_3 = RMSNorm(hidden, eps)
        self.norm_4 = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        kv_layer: int,
        ctx: LoopContext,
        ops: ModelOps,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.attn(ops.rms_norm(x, self.norm_1), kv_layer, ctx, ops, rows)
        _, h = ops.add_norm(attended, x, None, self.norm_2)
        mlp = self.mlp(ops.rms_norm(h, self.norm_3), ops, rows)
        _, y = ops.add_norm(mlp, h, None, self.norm_4)
        return y


class HuginnBody(nn.Module):
    """`transformer.*` in the checkpoint: the embedding, the three stages' layers, the adapter
    and `ln_f`."""

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__()
        hidden = config.hidden_size

        def stack(count: int, stage: bool) -> nn.ModuleList:
            return nn.ModuleList(SandwichBlock(config, stage) for _ in range(count))

        self.wte = nn.Embedding(config.vocab_size, hidden)
        self.prelude = stack(config.prelude_layers, stage=True)
        self.adapter = nn.Linear(2 * hidden, hidden, bias=False)
        self.core_block = stack(config.num_hidden_layers, stage=False)
        self.coda = stack(config.coda_layers, stage=True)
        self.ln_f = RMSNorm(hidden, config.rms_norm_eps)

    def blocks(self, stage: str) -> list[SandwichBlock]:
        """The layers of "prelude", "core_block" or "coda", typed."""
        return cast(list[SandwichBlock], list(getattr(self, stage)))


class HuginnForCausalLM(LoopedForCausalLM):
    """Huginn on the staged interface: prelude and coda layers keep K/V of their own."""

    config: HuginnConfig
    has_stage_layers = True
    exit_criterion = "latent-diff"

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__(config)
        self.transformer = HuginnBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # K/V layers: the block's 0 .. B-1, then the prelude's, then the coda's.
        self._prelude_kv = config.num_hidden_layers
        self._coda_kv = config.num_hidden_layers + config.prelude_layers

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def fuse_projections(self) -> None:
        """Huginn's checkpoint already projects q/k/v and gate/up with one matmul each."""

    @property
    def carried_size(self) -> int:
        return 2 * self.config.hidden_size

    @property
    def num_kv_layers(self) -> int:
        return self.config.num_hidden_layers + self.config.num_stage_layers

    @property
    def embedding(self) -> torch.Tensor:
        return self.transformer.wte.weight

    def parameter_stage(self, name: str) -> str | None:
        """The block and the adapter every loop; the prelude, the coda, `ln_f` and the (tied) LM
        head once per token."""
        if name.startswith(("transformer.core_block.", "transformer.adapter.")):
            return "loop"
        tied = name == "transformer.wte.weight" and self.config.tie_word_embeddings
        return "token" if tied or not name.startswith("transformer.wte.") else None

    def load_transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Adjacent-pair RoPE dimensions of q and k (Wqkv rows, the QK bias) in rotate-half
        order: each head's even dimensions, then its odd ones."""
        heads, head_dim = self.config.num_attention_heads, self.config.head_dim
        order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
        if name.endswith(".attn.Wqkv.weight"):
            q, k, v = tensor.chunk(3, dim=0)
            q, k = (part.view(heads, head_dim, -1)[:, order].reshape(v.shape) for part in (q, k))
            return torch.cat([q, k, v])
        if name.endswith(".attn.qk_bias"):
            return tensor[..., order]
        return tensor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids) * self.config.embed_scale

    def initial_state(self, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The random initial state of tokens at `positions` [T] with state seeds [T]: a normal
        of std `state_std` truncated at 3 std, times `embed_scale` ([T, H], the model dtype),
        by inverting the normal CDF of a counter-based uniform draw (fp32)."""
        config = self.config
        uniform = uniform_noise(seeds ^ STATE_STREAM, positions, config.hidden_size)
        probability = _LOW + uniform * (_HIGH - _LOW)
        normal = (math.sqrt(2.0) * torch.erfinv(2.0 * probability - 1.0)).clamp(-3.0, 3.0)
        return (normal * (config.state_std * config.embed_scale)).to(self.dtype)

    def start(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seeds: torch.Tensor,
        ctx: LoopContext | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[s0, e]: the seeded initial state and the prelude's output, [T, 2H]."""
        e = self.embed(input_ids)
        for index, layer in enumerate(self.transformer.blocks("prelude")):
            assert ctx is not None, "Huginn's prelude layers need their attention context"
            e = layer(e, self._prelude_kv + index, ctx, self.ops, rows)
        return torch.cat([self.initial_state(seeds, positions), e], dim=-1)

    def run_loop(self, hidden: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """[s, e] -> [core(adapter([s, e])), e]."""
        e = hidden[:, self.config.hidden_size :]
        x = self.ops.linear(hidden, self.transformer.adapter)
        for index, layer in enumerate(self.transformer.blocks("core_block")):
            x = layer(x, index, ctx, self.ops)
        return torch.cat([x, e], dim=-1)

    def exit_probability(
        self, hidden: torch.Tensor, previous: torch.Tensor, threshold: torch.Tensor | float
    ) -> torch.Tensor:
        """The official latent-diff criterion (the default) in fp32: the state converged when
        ||s_prev - s|| / ||s|| < threshold; λ = 1 then (the exit test's CDF reaches 1), else 0."""
        size = self.config.hidden_size
        state = hidden[:, :size].float()
        change = (previous[:, :size].float() - state).norm(dim=-1) / state.norm(dim=-1)
        return (change < threshold).float()

    @property
    def exit_memory_size(self) -> int:
        sizes = {"entropy-diff": 1, "kl": self.config.vocab_size, "minp-kl": self.config.vocab_size}
        return sizes.get(self.exit_criterion, 0)

    def initial_exit_memory(self, rows: int) -> torch.Tensor:
        """The official starting points: an entropy of 100; the uniform distribution's log."""
        start = (
            100.0 if self.exit_criterion == "entropy-diff" else -math.log(self.config.vocab_size)
        )
        return torch.full((rows, self.exit_memory_size), start, device=self.device)

    def readout_exit(
        self, logits: torch.Tensor, memory: torch.Tensor, threshold: torch.Tensor | float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The official logit criteria in fp32: `entropy-diff`, |H - H_prev| with H the entropy
        (log of p + 1e-10); `kl`, KL(p_prev || p); `minp-kl`, the same after probabilities under
        a tenth of the largest are set to 1/V and the rest renormalised."""
        if self.exit_criterion == "entropy-diff":
            probs = logits.softmax(dim=-1)
            entropy = -(probs * (probs + 1e-10).log()).sum(dim=-1)
            change, memory = (entropy - memory[:, 0]).abs(), entropy[:, None]
        else:
            if self.exit_criterion == "minp-kl":
                probs = logits.softmax(dim=-1)
                floor = 0.1 * probs.max(dim=-1, keepdim=True).values
                probs = torch.where(probs < floor, 1.0 / self.config.vocab_size, probs)
                log_probs = (probs / probs.sum(dim=-1, keepdim=True)).log()
            else:
                log_probs = logits.log_softmax(dim=-1)
            change = (memory.exp() * (memory - log_probs)).sum(dim=-1)
            memory = log_probs
        return (change < threshold).float(), memory

    def coda(
        self,
        hidden: torch.Tensor,
        ctx: LoopContext | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ln_f, the coda layers, ln_f again: the state [T, 2H] -> the LM head's input [T, H]."""
        ln_f = self.transformer.ln_f
        x = self.ops.rms_norm(hidden[:, : self.config.hidden_size].contiguous(), ln_f)
        for index, layer in enumerate(self.transformer.blocks("coda")):
            assert ctx is not None, "Huginn's coda layers need their attention context"
            x = layer(x, self._coda_kv + index, ctx, self.ops, rows)
        return self.ops.rms_norm(x, ln_f)
