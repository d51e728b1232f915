"""The two Ouro training objectives, on per-loop losses and gate logits.

Owns: the exit distribution implied by the per-loop hazards, the stage-1 loss (expected loss
under that distribution minus an entropy bonus) and the stage-2 gate targets and loss. Must not:
run the model; everything here is a function of [L, T] tensors.

With hazards λ_t = sigmoid(g_t), the probability of exiting after loop t is
p_t = λ_t Π_{j<t} (1 − λ_j) for t < L, and p_L = Π_{j<L} (1 − λ_j) (the last loop takes what is
left), which is the distribution the inference exit rule samples its CDF from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Stage1Terms:
    loss: torch.Tensor  # scalar: expected_loss - entropy_weight * entropy
    expected_loss: torch.Tensor  # scalar, mean over tokens of Σ_t p_t L_t
    entropy: torch.Tensor  # scalar, mean over tokens of H(p)
    exit_distribution: torch.Tensor  # [L] mean over tokens of p_t (detached)


def log_exit_distribution(gate_logits: torch.Tensor) -> torch.Tensor:
    """gate_logits [L, T] -> log p [L, T]; only loops 1..L-1 use their gate."""
    log_hazard = F.logsigmoid(gate_logits[:-1])  # [L-1, T] log λ_t
    log_continue = F.logsigmoid(-gate_logits[:-1])  # [L-1, T] log (1 - λ_t)
    zeros = torch.zeros_like(gate_logits[:1])
    survived_before = torch.cat((zeros, log_continue.cumsum(0)), dim=0)  # [L, T] Σ_{j<t}
    exit_here = torch.cat((log_hazard, zeros), dim=0)  # the last loop exits with certainty
    return survived_before + exit_here


def stage1_terms(
    losses: torch.Tensor, gate_logits: torch.Tensor, entropy_weight: float
) -> Stage1Terms:
    """losses, gate_logits [L, T] -> the stage-1 objective and its parts."""
    log_p = log_exit_distribution(gate_logits)
    p = log_p.exp()
    expected = (p * losses).sum(0).mean()
    entropy = -(p * log_p).sum(0).mean()
    return Stage1Terms(
        loss=expected - entropy_weight * entropy,
        expected_loss=expected,
        entropy=entropy,
        exit_distribution=p.mean(1).detach(),
    )


def exit_targets(losses: torch.Tensor, sharpness: float, margin: float) -> torch.Tensor:
    """losses [L, T] -> target exit hazards [L-1, T] for loops 1..L-1.

    The improvement of loop t+1 over loop t is max(0, L_t - L_{t+1}); the probability that
    continuing is worth it is w = sigmoid(sharpness * (improvement - margin)), and the gate after
    loop t should output the exit hazard 1 - w.
    """
    improvement = (losses[:-1] - losses[1:]).clamp(min=0.0)
    return 1.0 - torch.sigmoid(sharpness * (improvement - margin))


def stage2_loss(gate_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of the hazards of loops 1..L-1 against `exit_targets`."""
    return F.binary_cross_entropy_with_logits(gate_logits[:-1], targets)
