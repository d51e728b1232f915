"""Seeded exit-depth traces for the `trace` exit mode (benchmarks and tests).

Owns: the depth a traced token exits at, from its request's explicit list or drawn from a seeded
distribution (docs/looped-models.md §4). Must not: import torch. The depth of a request's k-th
decode computation depends only on (seed, k), so it is the same whatever the batch, the arrival
order or the scheduling mode, and the serial reference draws the same one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loopserve.sampling_params import ResolvedParams

# The standard distribution "d2.6" of docs/benchmarks.md: P(depth = 1, 2, 3, 4).
D2_6: tuple[float, ...] = (0.10, 0.40, 0.30, 0.20)
# Huginn-0125's "d12": depths 1..32 with probabilities falling linearly (P(d) ∝ a - d, a set so
# that the mean depth is 12, fixed depth's bound 32 / 12 = 2.67x; synthetic, like every trace).
_HUGINN_SLOPE = 5104 / 144  # sum(d (a - d)) / sum(a - d) = 12 over d = 1..32
D12: tuple[float, ...] = tuple(
    (_HUGINN_SLOPE - depth) / (32 * _HUGINN_SLOPE - 528) for depth in range(1, 33)
)
# Each family's default trace (`trace` mode without a distribution), by family: Ouro's d2.6;
# Nanbeige4.2's two loops: d1.6 (no gate exists, so any trace is synthetic: this one has the
# share of depth-1 exits that makes fixed depth's bound 1.25x); Huginn's d12.
FAMILY_TRACES: dict[str, tuple[float, ...]] = {
    "ouro": D2_6,
    "nanbeige": (0.4, 0.6),
    "huginn": D12,
}
_MASK64 = (1 << 64) - 1
# How errors name the setting (the engine field and its command-line flag).
_NAME = "trace_distribution (--trace-distribution)"
# How far from 1 probabilities given as such may sum (`check_distribution(normalized=True)`).
SUM_TOLERANCE = 1e-6


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def traced_depth(seed: int, decode_index: int, distribution: Sequence[float]) -> int:
    """Depth (1-based) drawn from `distribution` (P(depth = 1..len)) for one decode computation."""
    draw = _splitmix64(_splitmix64(seed) ^ decode_index) / 2.0**64
    total = sum(distribution)
    cumulative = 0.0
    for depth, probability in enumerate(distribution, start=1):
        cumulative += probability / total
        if draw < cumulative:
            return depth
    return len(distribution)


def check_distribution(distribution: Sequence[float], *, normalized: bool = False) -> None:
    """A distribution's own validity (its length is checked against the model in `fit_model`):
    finite, non-negative entries, not all zero; `normalized`: summing to 1 (the command line,
    where `0.5,0.5,0.5` is a typo, not weights)."""
    shown = ",".join(f"{p:g}" for p in distribution)
    if not distribution:
        raise ValueError(f"{_NAME} needs at least one probability (one per depth)")
    if not all(math.isfinite(p) and p >= 0 for p in distribution) or sum(distribution) <= 0:
        raise ValueError(f"{_NAME} entries must be finite, >= 0 and not all zero, got {shown}")
    total = math.fsum(distribution)
    if normalized and abs(total - 1.0) > SUM_TOLERANCE:
        raise ValueError(
            f"{_NAME} gives P(depth = 1, 2, ...), which must sum to 1, but {shown} sums to "
            f"{total:g}"
        )


def resolve_distribution(
    distribution: Sequence[float], family: str, num_loops: int
) -> tuple[float, ...]:
    """The distribution a `trace` engine uses: the one it was given, which must fit the model
    (`fit_model`), or (given none) its model family's default, cut to the model's loops (a model
    with fewer loops than the default has depths for)."""
    if distribution:
        fit_model(distribution, num_loops)
        return tuple(distribution)
    default = FAMILY_TRACES.get(family, (1.0,))[:num_loops]
    return default if sum(default) > 0 else (1.0,)


def fit_model(distribution: Sequence[float], num_loops: int) -> None:
    """A distribution used by a `trace` engine may not give depths the model does not have."""
    if len(distribution) > num_loops:
        raise ValueError(
            f"{_NAME} gives {len(distribution)} depths but the model runs at most {num_loops} "
            f"loops; pass at most one probability per depth 1..{num_loops}"
        )


def resolved_trace_depth(
    params: ResolvedParams, decode_index: int, distribution: Sequence[float]
) -> int:
    """The exit depth of a request's decode_index-th decode computation in `trace` mode.

    An explicit `trace_depths` list wins (entries past its end run max_loops); otherwise the depth
    is drawn from `distribution`. Either way it is clamped to [min_loops, max_loops].
    """
    depth = params.trace_depth(decode_index)
    if depth is None:
        if params.params.trace_depths is not None:
            depth = params.max_loops
        else:
            depth = traced_depth(params.seed, decode_index, distribution)
    return max(params.min_loops, min(depth, params.max_loops))


def trace_depths(params: ResolvedParams, distribution: Sequence[float]) -> tuple[int, ...]:
    """The exit depth of each of a request's decode computations (all but its first token)."""
    count = params.params.max_tokens - 1
    return tuple(resolved_trace_depth(params, index, distribution) for index in range(count))
