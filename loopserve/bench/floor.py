"""The bandwidth floor of an offline run: the least time the bytes and FLOPs it needed can take.

Owns: the arithmetic of the floor (`ModelBytes`, `Ceilings`, `WorkCounts` -> `FloorEstimate`), the
work counts derived from a `TrialRecord`, and the per-token floor of batch-1 decode. Must not:
import torch or measure anything (the ceilings come from `calibration.py`, the model's sizes
from the loaded weights).

Decode is bandwidth bound. Every decode step runs one loop, so it reads the core weights (every
layer and the final norm) once whatever its rows; every executed row-loop reads its context's
K/V of one plane; every step that samples a token reads the LM head once. Prefill is compute
bound: 2 × core parameters FLOPs per prompt token per loop against the matmul ceiling (attention
FLOPs ignored). The run's floor is the sum of the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.bench.trial import TrialRecord

FLOOR_METHOD = (
    "decode bytes / copy bandwidth + prefill FLOPs / matmul ceiling. Decode bytes = engine "
    "decode_steps x core weights (layers + final norm) + steps that sampled a token (distinct "
    "token timestamps; the engine stamps one time per step) x LM head + for every generated token "
    "after the first, exit_depth x (prompt_len + index) tokens x K/V bytes of one plane (exact "
    "contexts from the exit depths). Prefill FLOPs = 2 x core params x prompt tokens x loops "
    "(attention FLOPs ignored)."
)


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """Sizes of the model that the floor needs (in the dtype it runs in)."""

    core_weight_bytes: int  # every layer's weights + the final norm: read once per loop
    lm_head_bytes: int  # the readout (and any prelude layers): read once per step that samples
    kv_bytes_per_token_plane: int  # 2 × layers × kv_heads × head_dim × dtype bytes
    core_params: int  # prefill costs 2 × core_params FLOPs per token per loop


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Measured device limits."""

    copy_bytes_per_s: float  # bytes read + written per second by a large device copy
    matmul_flops_per_s: float  # a large matmul in the model's dtype


@dataclass(frozen=True, slots=True)
class WorkCounts:
    """What a run had to move and compute."""

    decode_steps: int
    lm_head_steps: int
    row_loops: int  # decode rows executed (from the exit depths)
    kv_token_reads: int  # Σ over row-loops of the context length in tokens
    prefill_token_loops: int  # Σ prompt tokens × loops they ran


@dataclass(frozen=True, slots=True)
class FloorEstimate:
    weight_bytes: int
    lm_head_bytes: int
    kv_bytes: int
    prefill_flops: int
    decode_s: float
    prefill_s: float

    @property
    def total_s(self) -> float:
        return self.decode_s + self.prefill_s


def work_counts(trial: TrialRecord) -> WorkCounts:
    """Count the work of a trial. Generated token k >= 1 of a request with prompt length P ran
    `exit_depths[k]` row-loops, each over a context of P + k tokens (positions 0 .. P + k - 1);
    token 0 came from the prompt's prefill, which ran `exit_depths[0]` loops."""
    row_loops = kv_token_reads = prefill_token_loops = 0
    stamps: set[float] = set()
    for request in trial.requests:
        prompt = request.num_prompt_tokens
        prefill_token_loops += prompt * request.exit_depths[0]
        for index in range(1, len(request.exit_depths)):
            depth = request.exit_depths[index]
            row_loops += depth
            kv_token_reads += depth * (prompt + index)
        stamps.update(request.token_times)
    return WorkCounts(
        decode_steps=trial.counters.decode_steps,
        lm_head_steps=len(stamps),
        row_loops=row_loops,
        kv_token_reads=kv_token_reads,
        prefill_token_loops=prefill_token_loops,
    )


def floor_estimate(model: ModelBytes, ceilings: Ceilings, work: WorkCounts) -> FloorEstimate:
    weight_bytes = work.decode_steps * model.core_weight_bytes
    lm_head_bytes = work.lm_head_steps * model.lm_head_bytes
    kv_bytes = work.kv_token_reads * model.kv_bytes_per_token_plane
    prefill_flops = 2 * model.core_params * work.prefill_token_loops
    return FloorEstimate(
        weight_bytes=weight_bytes,
        lm_head_bytes=lm_head_bytes,
        kv_bytes=kv_bytes,
        prefill_flops=prefill_flops,
        decode_s=(weight_bytes + lm_head_bytes + kv_bytes) / ceilings.copy_bytes_per_s,
        prefill_s=prefill_flops / ceilings.matmul_flops_per_s,
    )


def per_token_floor_s(model: ModelBytes, ceilings: Ceilings, depth: int, context: int) -> float:
    """Batch-1 decode of one token that runs `depth` loops over `context` tokens of K/V."""
    moved = depth * (model.core_weight_bytes + context * model.kv_bytes_per_token_plane)
    return (moved + model.lm_head_bytes) / ceilings.copy_bytes_per_s
