"""Stage 1 of tiny-model training: the whole model learns with the exit-weighted objective.

Owns: building the freshly initialised model, the AdamW optimiser and its warmup-cosine schedule,
and the stage-1 training loop with its progress records. Must not: define the objective (see
`objectives`), read the corpus, or write files.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from loopserve.models.ouro import OuroForCausalLM
from loopserve.train.config import ModelShape, Stage1Config
from loopserve.train.data import BatchSampler
from loopserve.train.looped_forward import loop_hidden_states, mean_loop_losses, per_loop_outputs
from loopserve.train.objectives import stage1_terms
from loopserve.train.progress import ProgressLog

# Std of every weight matrix and of the (tied) embedding at initialisation.
_INIT_STD = 0.02


def build_model(shape: ModelShape, gate_bias: float, seed: int) -> OuroForCausalLM:
    """A freshly initialised fp32 model on the CPU; the same seed gives the same weights."""
    generator = torch.Generator().manual_seed(seed)
    model = OuroForCausalLM(shape.to_ouro_config())
    gate = model.model.early_exit_gate
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param is gate.weight:
                param.zero_()  # every token starts with the same hazard, sigmoid(gate_bias)
            elif param is gate.bias:
                param.fill_(gate_bias)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * _INIT_STD)
    return model


def learning_rate(step: int, steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to `peak`, then cosine decay to `peak * min_ratio` at the last step."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _optimizer(model: OuroForCausalLM, config: Stage1Config) -> torch.optim.AdamW:
    gate = model.model.early_exit_gate
    gate_params = {id(gate.weight), id(gate.bias)}
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 and id(param) not in gate_params else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.95), fused=fused)


def train_stage1(
    model: OuroForCausalLM,
    sampler: BatchSampler,
    held_out: torch.Tensor,
    config: Stage1Config,
    autocast: torch.dtype | None,
    log: ProgressLog,
) -> None:
    """Train every parameter for `config.steps` steps, logging progress and held-out losses.

    Args:
        held_out: evaluation windows [W, S+1] for the periodic per-loop held-out loss.
        autocast: the autocast dtype on a GPU (bfloat16), None for plain fp32.
    """
    model.train()
    optimizer = _optimizer(model, config)
    device_type = held_out.device.type
    tokens_since, since = 0, time.perf_counter()
    for step in range(config.steps):
        rate = learning_rate(
            step, config.steps, config.learning_rate, config.warmup_steps, config.min_lr_ratio
        )
        for group in optimizer.param_groups:
            group["lr"] = rate
        inputs, targets = sampler.next_batch(config.batch_size)
        with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
            outputs = per_loop_outputs(model, loop_hidden_states(model, inputs), targets)
        terms = stage1_terms(outputs.losses, outputs.gate_logits, config.entropy_weight)
        optimizer.zero_grad(set_to_none=True)
        terms.loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        tokens_since += inputs.numel()
        last = step == config.steps - 1
        if step % config.log_every == 0 or last:
            now = time.perf_counter()
            log.emit(
                "stage1",
                step=step,
                loss=terms.expected_loss.item(),
                loop_losses=outputs.losses.detach().mean(1).tolist(),
                exit_dist=terms.exit_distribution.tolist(),
                entropy=terms.entropy.item(),
                grad_norm=grad_norm.item(),
                lr=rate,
                tokens_per_s=round(tokens_since / (now - since)),
            )
            tokens_since, since = 0, time.perf_counter()
        if (step + 1) % config.eval_every == 0 or last:
            model.eval()
            losses = mean_loop_losses(model, held_out, config.batch_size, autocast)
            log.emit("heldout", step=step, loop_losses=losses)
            model.train()
            tokens_since, since = 0, time.perf_counter()
    model.eval()
