"""Stage 2 of tiny-model training: the model is frozen and only the exit gate learns.

Owns: the gate-only training loop. For every token and loop t < L the gate's target is the
probability that loop t+1 no longer improves the token's loss (see `objectives.exit_targets`).
Must not: change any weight but `model.early_exit_gate`.
"""

from __future__ import annotations

import time

import torch

from loopserve.data.windows import BatchSampler
from loopserve.models.ouro import OuroForCausalLM
from loopserve.train.config import Stage2Config
from loopserve.train.looped_forward import (
    gate_logit,
    loop_hidden_states,
    mixed_precision,
    per_loop_outputs,
)
from loopserve.train.objectives import exit_targets, stage2_loss
from loopserve.train.progress import ProgressLog
from loopserve.train.stage1 import learning_rate


def _frozen_pass(
    model: OuroForCausalLM,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast: torch.dtype | None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Hidden states after each loop ([T, H] each, detached) and per-loop losses [L, T]."""
    with torch.no_grad(), mixed_precision(inputs.device.type, autocast):
        states = loop_hidden_states(model, inputs)
        losses = per_loop_outputs(model, states, targets).losses
    return states, losses


def train_stage2(
    model: OuroForCausalLM,
    sampler: BatchSampler,
    config: Stage2Config,
    autocast: torch.dtype | None,
    log: ProgressLog,
) -> None:
    """Train the gate for `config.steps` steps on fresh batches; everything else stays frozen."""
    model.eval().requires_grad_(False)
    gate = model.model.early_exit_gate
    gate.requires_grad_(True)
    optimizer = torch.optim.Adam(gate.parameters(), lr=config.learning_rate)
    tokens_since, since = 0, time.perf_counter()
    for step in range(config.steps):
        rate = learning_rate(step, step / config.steps, config.learning_rate, 0, 0.1)
        for group in optimizer.param_groups:
            group["lr"] = rate
        inputs, targets = sampler.next_batch(config.batch_size)
        states, losses = _frozen_pass(model, inputs, targets, autocast)
        wanted = exit_targets(losses, config.sharpness, config.margin)  # [L-1, T]
        logits = torch.stack([gate_logit(model, hidden) for hidden in states])  # [L, T]
        loss = stage2_loss(logits, wanted)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        tokens_since += inputs.numel()
        if step % config.log_every == 0 or step == config.steps - 1:
            now = time.perf_counter()
            hazards = torch.sigmoid(logits[:-1].detach())
            log.emit(
                "stage2",
                step=step,
                gate_loss=loss.item(),
                target_exit=wanted.mean(1).tolist(),
                hazard=hazards.mean(1).tolist(),
                tokens_per_s=round(tokens_since / (now - since)),
            )
            tokens_since, since = 0, time.perf_counter()
    gate.requires_grad_(False)
