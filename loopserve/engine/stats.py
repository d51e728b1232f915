"""What the engine counts: the scheduler's counters and the snapshot `Engine.stats()` returns.

Owns: `SchedulerStats` and `EngineStats`. Must not: import torch.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    # Rows executed per loop index (1-based) and decode steps by their number of rows.
    row_loops: Counter[int] = field(default_factory=Counter)
    rows_per_step: Counter[int] = field(default_factory=Counter)
    prefill_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    swapped_out_pages: int = 0
    recomputed_tokens: int = 0  # prefill positions run again after recompute preemptions
    # Speculation: proposed tokens that got a decode row, and those equal to the final token.
    proposed_tokens: int = 0
    confirmed_tokens: int = 0
    speculative_tokens: int = 0  # tokens made final by speculating decode steps
    speculation_switches: int = 0  # steps that turned speculation on or off
    # Prompt tokens looked up in the prefix cache, and those found there.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    @property
    def total_row_loops(self) -> int:
        return sum(self.row_loops.values())

    @property
    def mean_rows_per_decode_step(self) -> float:
        return self.total_row_loops / self.decode_steps if self.decode_steps else 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_total: int  # usable pages (the null page excluded)
    kv_pages_used: int
    kv_pages_free: int
    kv_pages_cached: int  # free pages that still hold a cached prompt block
    steps: int
    decode_steps: int
    # Occupancy: decode rows per decode step, and rows executed at each loop index.
    mean_rows_per_decode_step: float
    row_loops_by_loop: dict[int, int]
    rows_per_step: dict[int, int]
    prefill_tokens: int
    generated_tokens: int
    num_preemptions: int
    recomputed_tokens: int  # prefill positions run again after recompute preemptions
    prefix_cache_hit_rate: float  # prompt tokens found in the prefix cache / prompt tokens
    prefix_hit_tokens: int
    prefix_query_tokens: int
    # Speculation (docs/speculation.md): proposed tokens that got a decode row, those found
    # equal to the final token, and the share confirmed (0 without speculation).
    proposed_tokens: int = 0
    confirmed_tokens: int = 0
    speculative_tokens: int = 0  # tokens made final by speculating decode steps
    speculating: bool = False  # the last step ran the speculating decode step
    speculation_switches: int = 0  # steps that turned speculation on or off (disable_by_batch_size)

    @property
    def proposal_acceptance_rate(self) -> float:
        return self.confirmed_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def speculative_drafts(self) -> int:
        """Chains: a final token of a speculating step that is not a confirmed proposal starts
        one, and the confirmed proposals after it extend it (vLLM's draft rounds)."""
        return max(self.speculative_tokens - self.confirmed_tokens, 0)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per chain, 1 + accepted / drafts as vLLM reports it (0 without speculation)."""
        drafts = self.speculative_drafts
        return 1 + self.confirmed_tokens / drafts if drafts else 0.0
