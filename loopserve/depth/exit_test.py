"""The Ouro exit test in fp32, shared by the decode step, the serial reference and the evaluators.

Owns: the arithmetic of docs/looped-models.md §2 (survival and CDF after each loop, the threshold
test). Must not: import torch, or decide exit *modes* (delayed, trace, fixed depth): `policy`
combines this test with them.

With hazards λ_j of loops j = 1..d, survival S_d = Π_{j<=d} (1 − λ_j) and CDF_d = 1 − S_d. A token
may exit after loop d when d >= min_loops and CDF_d >= threshold (and must at max_loops). Every
implementation computes S_d by this exact sequence of fp32 operations, so that all of them agree
bit for bit on where a token exits; that includes the Triton twin of the CUDA decode step
(`kernels/decode_state.py`, tested against this by tests/kernels/test_decode_state.py).
"""

from __future__ import annotations

from typing import Any


def next_survival(survival: Any, hazard: Any) -> Any:
    """survival [R] fp32 after d-1 loops, hazard λ_d [R] fp32 -> survival after d loops."""
    return survival * (1.0 - hazard)


def threshold_reached(survival: Any, loop: Any, min_loops: Any, threshold: Any) -> Any:
    """The exit test after `loop` loops (1-based): loop >= min_loops and 1 - S >= threshold.

    `survival` is an fp32 tensor; a Python float threshold is compared in fp32, like a tensor one.
    """
    return ((1.0 - survival) >= threshold) & (loop >= min_loops)
