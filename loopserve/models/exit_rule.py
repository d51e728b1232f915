"""The Ouro exit rule in fp32, shared by the serial reference, the runner and the evaluators.

Owns: the arithmetic of ARCHITECTURE.md §1 (survival and CDF after each loop, the threshold test).
Must not: decide exit *modes* (delayed, trace, fixed depth): callers combine this test with them.

With hazards λ_j of loops j = 1..d, survival S_d = Π_{j<=d} (1 − λ_j) and CDF_d = 1 − S_d. A token
may exit after loop d when d >= min_loops and CDF_d >= threshold (and must at max_loops). Every
implementation computes S_d by this exact sequence of fp32 operations, so that all of them agree
bit for bit on where a token exits.
"""

from __future__ import annotations

import torch


def next_survival(survival: torch.Tensor, hazard: torch.Tensor) -> torch.Tensor:
    """survival [R] fp32 after d-1 loops, hazard λ_d [R] fp32 -> survival after d loops."""
    return survival * (1.0 - hazard)


def threshold_reached(
    survival: torch.Tensor,
    loop: torch.Tensor | int,
    min_loops: torch.Tensor | int,
    threshold: torch.Tensor | float,
) -> torch.Tensor:
    """The exit test after `loop` loops (1-based): loop >= min_loops and 1 - S >= threshold."""
    device = survival.device
    cdf = 1.0 - survival
    reached = cdf >= torch.as_tensor(threshold, dtype=torch.float32, device=device)
    deep_enough = torch.as_tensor(loop, device=device) >= torch.as_tensor(min_loops, device=device)
    return reached & deep_enough
