"""Scheduler settings and counters.

Owns: `SchedulerConfig` (frozen, validated) and `SchedulerStats` (what the scheduler counted).
Must not: import torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from loopserve.engine.trace import D2_6

KV_LAYOUTS = ("full", "shared")
SCHEDULING_MODES = ("refill", "no_refill")
EXIT_MODES = ("ouro", "ouro_delayed", "trace")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Requests admitted at once (each holds a row of the runner's per-slot state).
    max_num_seqs: int = 64
    # Decode rows plus prompt-chunk tokens per step.
    max_num_batched_tokens: int = 2048
    # Longest prompt chunk of one request in one step.
    prefill_chunk_size: int = 512
    # "refill": a slot freed by an exit is reused at once; "no_refill": cohorts drain first.
    scheduling: str = "refill"
    # "ouro" (exact gate), "ouro_delayed" (stop one loop after the test holds), "trace".
    exit_mode: str = "ouro"
    # "full": one KV plane per loop; "shared": prompts keep per-loop planes while prefilling,
    # afterwards every token keeps only its final version.
    kv_layout: str = "full"
    block_size: int = 16
    # P(depth = 1, 2, ...) for traced tokens whose request gives no explicit depths.
    trace_distribution: tuple[float, ...] = D2_6
    # Hand decoding to the device-resident decoder (see engine/device_decode.py) instead of
    # scheduling decode rows; requests then hold all their pages from admission on.
    decode_on_device: bool = False

    def __post_init__(self) -> None:
        checks = {
            "scheduling": (self.scheduling, SCHEDULING_MODES),
            "exit_mode": (self.exit_mode, EXIT_MODES),
            "kv_layout": (self.kv_layout, KV_LAYOUTS),
        }
        for name, (value, choices) in checks.items():
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        if min(self.max_num_seqs, self.prefill_chunk_size, self.block_size) < 1:
            raise ValueError("max_num_seqs, prefill_chunk_size and block_size must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}) so every decode row fits in a step"
            )


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    # Rows executed per loop index (1-based) and steps by their number of decode rows.
    row_loops: Counter[int] = field(default_factory=Counter)
    rows_per_step: Counter[int] = field(default_factory=Counter)
    prefill_tokens: int = 0
    generated_tokens: int = 0

    @property
    def total_row_loops(self) -> int:
        return sum(self.row_loops.values())

    @property
    def mean_rows_per_decode_step(self) -> float:
        return self.total_row_loops / self.decode_steps if self.decode_steps else 0.0
