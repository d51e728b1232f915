"""The training objectives agree with the inference exit rule and point the right way."""

from __future__ import annotations

import math

import torch

from loopserve.depth.exit_test import next_survival
from loopserve.train.objectives import (
    exit_targets,
    log_exit_distribution,
    stage1_terms,
    stage2_loss,
)


def test_exit_distribution_is_the_exit_rules_cdf() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_logits = 2.0 * torch.randn(4, 50, generator=generator)  # [L, T]
    p = log_exit_distribution(gate_logits).exp()
    assert torch.allclose(p.sum(0), torch.ones(50), atol=1e-6)
    survival = torch.ones(50)
    for loop in range(3):  # loops 1..L-1: P(exit by loop d) = 1 - S_d
        survival = next_survival(survival, torch.sigmoid(gate_logits[loop]))
        assert torch.allclose(p[: loop + 1].sum(0), 1.0 - survival, atol=1e-6)


def test_stage1_prefers_the_better_loop_and_rewards_spread() -> None:
    losses = torch.tensor([[3.0], [2.0], [1.5], [1.0]])  # [L=4, T=1]
    deep = torch.tensor([[-5.0], [-5.0], [-5.0], [0.0]])  # almost always runs 4 loops
    shallow = torch.tensor([[5.0], [0.0], [0.0], [0.0]])  # almost always exits after loop 1
    assert stage1_terms(losses, deep, 0.0).loss < stage1_terms(losses, shallow, 0.0).loss
    uniform = torch.tensor([[math.log(1 / 3)], [math.log(1 / 2)], [0.0], [0.0]])
    terms = stage1_terms(losses, uniform, entropy_weight=0.5)
    assert math.isclose(terms.entropy.item(), math.log(4), rel_tol=1e-5)
    assert math.isclose(terms.expected_loss.item(), 7.5 / 4, rel_tol=1e-5)
    assert math.isclose(terms.loss.item(), 7.5 / 4 - 0.5 * math.log(4), rel_tol=1e-5)


def test_stage1_gradient_moves_the_gate_towards_deeper_loops() -> None:
    losses = torch.tensor([[4.0], [3.0], [2.0], [1.0]])
    gate_logits = torch.zeros(4, 1, requires_grad=True)
    stage1_terms(losses, gate_logits, entropy_weight=0.01).loss.backward()
    assert gate_logits.grad is not None
    assert (gate_logits.grad[:3] > 0).all()  # descending the loss lowers every exit hazard


def test_exit_targets_follow_the_improvement_of_the_next_loop() -> None:
    # Token 0 still improves a lot at every loop; token 1 stops improving after loop 1.
    losses = torch.tensor([[3.0, 2.0], [2.0, 2.0], [1.0, 2.1]])  # [L=3, T=2]
    targets = exit_targets(losses, sharpness=50.0, margin=0.005)  # [2, 2]
    assert (targets[:, 0] < 0.01).all()
    assert (targets[:, 1] > 0.5).all()
    perfect = torch.logit(targets.clamp(1e-4, 1 - 1e-4))
    wrong = -perfect
    padded = torch.cat((perfect, torch.zeros(1, 2)))
    assert stage2_loss(padded, targets) < stage2_loss(
        torch.cat((wrong, torch.zeros(1, 2))), targets
    )
