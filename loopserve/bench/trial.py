"""What one trial of the closed loop recorded: its finished requests, the engine's counters over
it and the peaks it reached.

Owns: the record types the closed loop fills and the figures and the floor read. Must not: compute
anything, or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, reduced to what the figures and the floor need."""

    request_id: str
    num_prompt_tokens: int
    exit_depths: tuple[int, ...]  # loops run for each generated token (the first: all of them)
    arrival_time: float  # time.monotonic() seconds
    first_token_time: float
    token_times: tuple[float, ...]  # one per generated token
    finished_time: float


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Differences of the engine's cumulative statistics over one loop."""

    decode_steps: int  # steps that ran at least one decode row (one loop of the stack each)
    row_loops: int  # decode rows executed, summed over steps
    prefill_tokens: int
    generated_tokens: int
    preemptions: int = 0
    prefix_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens admitted
    proposed_tokens: int = 0  # speculation: proposals that got a decode row
    confirmed_tokens: int = 0  # speculation: proposals found equal to the final token
    speculative_drafts: int = 0  # speculation: chains of proposals (EngineStats says)


@dataclass(frozen=True, slots=True)
class TrialRecord:
    requests: list[RequestRecord]
    duration_s: float
    counters: EngineCounters
    peak_kv_pages: int  # most KV pages in use after any step
    kv_pages_total: int  # usable pages of the engine
    peak_running: int  # most requests the engine ran at once
    min_in_flight_while_queued: int  # fewest in flight at a step while requests still waited
    peak_memory_bytes: int | None = None  # filled in by the caller on CUDA
