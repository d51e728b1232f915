"""The training forward pass: a batch of windows through every loop of an `OuroForCausalLM`.

Owns: batched causal attention over [B, S] windows for the model's flat-token interface, and
collecting what the objectives need after each loop (per-token loss, gate logit). Must not:
define the objectives, or any early-exit KV semantics (training always runs every loop; exact
early-exit evaluation lives in `loopserve.eval.early_exit_perplexity`).

Shapes: B windows of S tokens, T = B*S flattened tokens, L loops, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loopserve.models.layers import LoopContext
from loopserve.models.ouro import OuroForCausalLM
from loopserve.models.window_attention import causal_attention


@dataclass(slots=True)
class LoopOutputs:
    losses: torch.Tensor  # [L, T] fp32 cross-entropy of the next token after each loop
    gate_logits: torch.Tensor  # [L, T] fp32; the exit hazard is sigmoid(gate_logit)


def mixed_precision(device_type: str, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast to `dtype` (bf16 on a GPU), or a disabled context for plain fp32 (dtype None)."""
    return torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None)


def gate_logit(model: OuroForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [T, H] -> fp32 [T]; `model.exit_probability` is the sigmoid of this."""
    gate = model.model.early_exit_gate
    with torch.autocast(hidden.device.type, enabled=False):  # fp32, like exit_probability
        return F.linear(hidden.float(), gate.weight.float(), gate.bias.float()).squeeze(-1)


def loop_context(
    model: OuroForCausalLM, batch: int, seq_len: int, device: torch.device
) -> LoopContext:
    positions = torch.arange(seq_len, device=device).repeat(batch)  # [T]
    cos, sin = model.rope(positions)
    return LoopContext(cos=cos, sin=sin, attention=causal_attention(batch, seq_len))


def loop_hidden_states(model: OuroForCausalLM, inputs: torch.Tensor) -> list[torch.Tensor]:
    """inputs [B, S] -> the normalised hidden state [T, H] after each of the L loops."""
    batch, seq_len = inputs.shape
    ctx = loop_context(model, batch, seq_len, inputs.device)
    hidden = model.embed(inputs.reshape(-1))  # [T, H]
    states = []
    for _ in range(model.config.num_loops):
        hidden = model.run_loop(hidden, ctx)
        states.append(hidden)
    return states


def per_loop_outputs(
    model: OuroForCausalLM, states: list[torch.Tensor], targets: torch.Tensor
) -> LoopOutputs:
    """Per-loop next-token losses and gate logits; targets [B, S]."""
    flat_targets = targets.reshape(-1)  # [T]
    losses, logits = [], []
    for hidden in states:
        token_logits = model.compute_logits(hidden)  # [T, V] fp32
        losses.append(F.cross_entropy(token_logits, flat_targets, reduction="none"))
        logits.append(gate_logit(model, hidden))
    return LoopOutputs(losses=torch.stack(losses), gate_logits=torch.stack(logits))


@torch.no_grad()
def mean_loop_losses(
    model: OuroForCausalLM, windows: torch.Tensor, batch_size: int, autocast: torch.dtype | None
) -> list[float]:
    """Mean next-token loss after each loop over evaluation windows [W, S] (fixed full depth)."""
    totals = torch.zeros(model.config.num_loops, dtype=torch.float64, device=windows.device)
    count = 0
    for start in range(0, windows.shape[0], batch_size):
        chunk = windows[start : start + batch_size]
        with mixed_precision(windows.device.type, autocast):
            states = loop_hidden_states(model, chunk[:, :-1])
            outputs = per_loop_outputs(model, states, chunk[:, 1:])
        totals += outputs.losses.double().sum(1)
        count += outputs.losses.shape[1]
    return (totals / count).tolist()
