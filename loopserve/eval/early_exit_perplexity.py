"""Exact teacher-forced scoring with gate-driven early exit, computed densely loop by loop.

Owns: the log-probability of every next token of a batch of windows, and the loop after which
each position exited, under the `full` KV layout (docs/looped-models.md §3) and the `ouro` exit
mode.
Must not: sample, batch requests, or use any exit arithmetic but `loopserve.depth.exit_test`.

Teacher forcing as the serial reference does it: position 0 of a window is the prompt and runs
all `max_loops` loops; every later position is a forced token that runs loops until the exit rule
fires. Position p's logits at its exit loop e_p predict token p+1. A query at loop d sees every
earlier position j at KV version min(d, e_j): at loop d all positions still running compute
fresh K/V, positions that exited earlier keep the K/V of their exit loop. Running this for all
positions at once is exact because a position's exit depends only on earlier positions.

Shapes: B windows of S tokens, T = B*S flattened, H hidden, L loops, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.depth.exit_test import next_survival, threshold_reached
from loopserve.kv.storage import K, KVFormat, KVScales, V
from loopserve.models.layers import LoopContext
from loopserve.models.looped import PROMPT_STATE_SEED, LoopedForCausalLM
from loopserve.models.window_attention import causal_attention


@dataclass(frozen=True, slots=True)
class ExitSettings:
    """The depth settings of one evaluation (as the SamplingParams fields of the same names)."""

    # 1.0: fixed depth (the gate is not evaluated); below 1: exit once the CDF reaches it.
    exit_threshold: float
    max_loops: int
    min_loops: int = 1

    def __post_init__(self) -> None:
        if not 0.0 < self.exit_threshold <= 1.0:
            raise ValueError(f"exit_threshold must be in (0, 1], got {self.exit_threshold}")
        if not 1 <= self.min_loops <= self.max_loops:
            raise ValueError(
                f"need 1 <= min_loops ({self.min_loops}) <= max_loops ({self.max_loops})"
            )


@dataclass(slots=True)
class WindowScores:
    logprobs: torch.Tensor  # [B, S-1] fp32: log p(token p+1 | tokens <= p) at p's exit loop
    exit_depths: torch.Tensor  # [B, S-1] int64: loops run by position p


class _FrozenKVAttention:
    """Causal attention in which positions that exited keep the K/V of their exit loop (rounded as
    a cache stores them, where `kv_format` says: an fp8 cache)."""

    def __init__(self, batch: int, seq_len: int, num_layers: int, kv_format: KVFormat) -> None:
        self.batch, self.seq_len = batch, seq_len
        self.kv_format = kv_format
        self._attend = causal_attention(batch, seq_len)
        self.running = torch.ones(batch * seq_len, dtype=torch.bool)  # [T]
        # The latest K/V version of every position, per layer: [T, Nkv, D].
        self._keys: list[torch.Tensor | None] = [None] * num_layers
        self._values: list[torch.Tensor | None] = [None] * num_layers

    def _latest(
        self, store: list[torch.Tensor | None], layer: int, fresh: torch.Tensor
    ) -> torch.Tensor:
        previous = store[layer]
        merged = (
            fresh if previous is None else torch.where(self.running[:, None, None], fresh, previous)
        )
        store[layer] = merged
        return merged

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k = self._latest(self._keys, layer, self.kv_format.stored(k, layer, K))
        v = self._latest(self._values, layer, self.kv_format.stored(v, layer, V))
        return self._attend(layer, q, k, v)


def _exits_after_loop(
    loop: int, survival: torch.Tensor, is_prompt: torch.Tensor, settings: ExitSettings
) -> torch.Tensor:
    """[T] bool: positions whose exit rule fires after `loop` (prompt positions run every loop)."""
    if loop == settings.max_loops:
        return torch.ones_like(is_prompt)
    if settings.exit_threshold >= 1.0:
        return torch.zeros_like(is_prompt)
    reached = threshold_reached(survival, loop, settings.min_loops, settings.exit_threshold)
    return reached & ~is_prompt


@torch.no_grad()
def score_windows(
    model: LoopedForCausalLM,
    windows: torch.Tensor,
    settings: ExitSettings,
    kv_dtype: torch.dtype | None = None,
    kv_scales: KVScales | None = None,
) -> WindowScores:
    """Teacher-forced log-probabilities and exit depths for windows [B, S] (see module doc);
    `kv_dtype`: the block's K/V rounded as a cache of that dtype keeps them (fp8), with the
    per-layer `kv_scales` (None: 1)."""
    if settings.max_loops > model.config.num_loops:
        raise ValueError(
            f"max_loops {settings.max_loops} exceeds the model's {model.config.num_loops} loops"
        )
    if model.has_stage_layers and settings.exit_threshold < 1.0:
        raise ValueError(
            f"early-exit perplexity is not implemented for {model.config.family}: its coda "
            "layers attend to earlier positions' coda K/V, which a teacher-forced window has only "
            "once those positions exited; measure fixed depths (exit threshold 1.0)"
        )
    batch, seq_len = windows.shape
    device = windows.device
    kv_format = KVFormat(kv_dtype, kv_scales)
    attention = _FrozenKVAttention(batch, seq_len, model.config.num_hidden_layers, kv_format)
    attention.running = attention.running.to(device)
    positions = torch.arange(seq_len, device=device).repeat(batch)  # [T]
    is_prompt = positions == 0
    targets = torch.roll(windows, shifts=-1, dims=1).reshape(-1)  # [T]; the last column is unused
    cos, sin = model.rope(positions)
    ctx = LoopContext(cos=cos, sin=sin, attention=attention)
    # Prelude and coda layers (fixed depth only, see above): plain causal attention over a window.
    stages = LoopContext(cos=cos, sin=sin, attention=causal_attention(batch, seq_len))
    seeds = torch.full_like(positions, PROMPT_STATE_SEED)
    hidden = model.start(windows.reshape(-1), positions, seeds, stages)  # [T, carried]
    survival = torch.ones(batch * seq_len, dtype=torch.float32, device=device)
    logprobs = torch.zeros(batch * seq_len, dtype=torch.float32, device=device)
    depths = torch.zeros(batch * seq_len, dtype=torch.int64, device=device)
    for loop in range(1, settings.max_loops + 1):
        previous, hidden = hidden, model.run_loop(hidden, ctx)
        running = attention.running
        if settings.exit_threshold < 1.0 and loop < settings.max_loops:
            hazard = model.exit_probability(hidden, previous, settings.exit_threshold)  # [T] fp32
            survival = torch.where(running, next_survival(survival, hazard), survival)
        exits = running & _exits_after_loop(loop, survival, is_prompt, settings)
        if exits.any():
            rows = exits.nonzero().squeeze(-1)
            logits = model.compute_logits(hidden[rows], ctx=stages)  # [R, V]
            log_softmax = torch.log_softmax(logits, dim=-1)
            logprobs[rows] = log_softmax.gather(1, targets[rows, None]).squeeze(-1)
            depths[rows] = loop
        attention.running = running & ~exits
    return WindowScores(
        logprobs=logprobs.view(batch, seq_len)[:, :-1],
        exit_depths=depths.view(batch, seq_len)[:, :-1],
    )
