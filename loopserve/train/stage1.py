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

from loopserve.data.windows import BatchSampler
from loopserve.models.ouro import OuroForCausalLM
from loopserve.train.config import ModelShape, Stage1Config
from loopserve.train.looped_forward import (
    loop_hidden_states,
    mean_loop_losses,
    mixed_precision,
    per_loop_outputs,
)
from loopserve.train.objectives import stage1_terms
from loopserve.train.progress import ProgressLog

# Std of every weight matrix (and of an untied LM head) at initialisation.
_INIT_STD = 0.02
# The norms that close each residual branch.
_BRANCH_NORMS = ("input_layernorm_2.weight", "post_attention_layernorm_2.weight")


def _initial_value(
    name: str, shape: torch.Size, config: Stage1Config, hidden: int, generator: torch.Generator
) -> torch.Tensor:
    if name.endswith(_BRANCH_NORMS):
        return torch.full(shape, config.branch_norm_init)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name == "model.early_exit_gate.weight":
        return torch.zeros(shape)  # every token starts with the same hazard, sigmoid(bias)
    if name == "model.early_exit_gate.bias":
        return torch.full(shape, config.gate_bias_init)
    std = config.embedding_init_scale / math.sqrt(hidden) if "embed" in name else _INIT_STD
    return torch.randn(shape, generator=generator) * std


def build_model(shape: ModelShape, config: Stage1Config, seed: int) -> OuroForCausalLM:
    """A freshly initialised fp32 model on the CPU; the same seed gives the same weights."""
    generator = torch.Generator().manual_seed(seed)
    model = OuroForCausalLM(shape.to_ouro_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(_initial_value(name, param.shape, config, shape.hidden_size, generator))
    return model


def learning_rate(step: int, progress: float, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay from `peak` to `peak * min_ratio` as
    `progress` (the fraction of the run after warmup) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, max(0.0, progress))
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class _Schedule:
    """Where stage 1 is: by steps, or by wall time once `time_limit_s` would be exceeded."""

    def __init__(self, config: Stage1Config) -> None:
        self._config = config
        self._start = time.perf_counter()

    def progress(self, step: int) -> float:
        config = self._config
        by_steps = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        if config.time_limit_s is None:
            return by_steps
        return max(by_steps, (time.perf_counter() - self._start) / config.time_limit_s)

    def rate(self, step: int) -> float:
        config = self._config
        return learning_rate(
            step,
            self.progress(step),
            config.learning_rate,
            config.warmup_steps,
            config.min_lr_ratio,
        )

    def finished(self, step: int) -> bool:
        """True after the last step (the step count, or the time limit once warmup is over)."""
        return step >= self._config.steps or (
            step > self._config.warmup_steps and self.progress(step) >= 1.0
        )


def _optimizer(model: OuroForCausalLM, config: Stage1Config) -> torch.optim.AdamW:
    gate = model.model.early_exit_gate
    gate_params = {id(gate.weight), id(gate.bias)}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for param in model.parameters():
        (decay if param.ndim >= 2 and id(param) not in gate_params else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.95), fused=fused)


def _step(
    model: OuroForCausalLM,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: Stage1Config,
    autocast: torch.dtype | None,
    learn_gate: bool,
) -> dict[str, object]:
    """One optimiser step; returns the progress record's values (tensors, not yet synced)."""
    with mixed_precision(inputs.device.type, autocast):
        outputs = per_loop_outputs(model, loop_hidden_states(model, inputs), targets)
    terms = stage1_terms(outputs.losses, outputs.gate_logits, config.entropy_weight)
    optimizer.zero_grad(set_to_none=True)
    terms.loss.backward()
    if not learn_gate:  # the optimiser skips parameters without a gradient
        for param in model.model.early_exit_gate.parameters():
            param.grad = None
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return {
        "loss": terms.expected_loss,
        "loop_losses": outputs.losses.detach().mean(1),
        "exit_dist": terms.exit_distribution,
        "entropy": terms.entropy,
        "grad_norm": grad_norm,
    }


def _synced(values: dict[str, object]) -> dict[str, object]:
    return {
        key: value.tolist() if isinstance(value, torch.Tensor) else value
        for key, value in values.items()
    }


def train_stage1(
    model: OuroForCausalLM,
    sampler: BatchSampler,
    held_out: torch.Tensor,
    config: Stage1Config,
    autocast: torch.dtype | None,
    log: ProgressLog,
) -> int:
    """Train every parameter, logging progress and held-out losses; returns the steps run.

    Args:
        held_out: evaluation windows [W, S+1] for the periodic per-loop held-out loss.
        autocast: the autocast dtype on a GPU (bfloat16), None for plain fp32.
    """
    model.train()
    optimizer = _optimizer(model, config)
    schedule = _Schedule(config)
    tokens_since, since = 0, time.perf_counter()
    step = 0
    while not schedule.finished(step):
        rate = schedule.rate(step)
        for group in optimizer.param_groups:
            group["lr"] = rate
        inputs, targets = sampler.next_batch(config.batch_size)
        learn_gate = step >= config.gate_frozen_fraction * config.steps
        values = _step(model, optimizer, inputs, targets, config, autocast, learn_gate)
        tokens_since += inputs.numel()
        step += 1
        last = schedule.finished(step)
        if (step - 1) % config.log_every == 0 or last:
            rate_now = round(tokens_since / (time.perf_counter() - since))
            log.emit("stage1", step=step - 1, **_synced(values), lr=rate, tokens_per_s=rate_now)
            tokens_since, since = 0, time.perf_counter()
        if step % config.eval_every == 0 or last:
            model.eval()
            losses = mean_loop_losses(model, held_out, config.batch_size, autocast)
            log.emit("heldout", step=step - 1, loop_losses=losses)
            model.train()
            tokens_since, since = 0, time.perf_counter()
    model.eval()
    return step
