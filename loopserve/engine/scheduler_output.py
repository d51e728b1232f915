"""The contracts between the scheduler and the model runner, in plain ints and floats.

Owns: `SchedulerOutput` (what one engine step runs) and `RunnerOutput` (what it produced).
Must not: import torch. The scheduler fills the first, the runner the second, and neither reaches
into the other's state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from loopserve.outputs import TokenLogprobs
from loopserve.sampling_params import SamplingParams


class ExitCheck(enum.Enum):
    """What decides whether a decode row's token exits after this loop."""

    CONTINUE = "continue"  # it runs another loop
    EXIT = "exit"  # it exits (max depth, trace depth, or a delayed exit)
    IF_GATE = "if_gate"  # it exits iff the exit test holds after this loop (`ouro` mode)


@dataclass(frozen=True, slots=True)
class SamplingInfo:
    """What the coda needs to sample a request's next token, batch-independently."""

    params: SamplingParams
    seed: int
    output_index: int  # index of the token being sampled among the request's outputs


@dataclass(slots=True)
class DecodeRow:
    """One loop of one request's in-flight token."""

    request_id: str
    slot: int  # the request's row in the runner's per-slot state
    loop: int  # 1-based loop this step runs
    position: int
    input_token: int  # the in-flight token (embedded when loop == 1)
    plane: int  # the page table this row writes and reads
    exit: ExitCheck
    evaluate_gate: bool  # compute λ and update the survival (ouro modes)
    survival: float  # Π(1 − λ) over the token's earlier loops
    min_loops: int
    exit_threshold: float
    sampling: SamplingInfo


@dataclass(slots=True)
class PrefillChunk:
    """Prompt tokens [start, start + len(token_ids)) of one request, run through every loop."""

    request_id: str
    slot: int
    start: int
    token_ids: list[int]
    num_loops: int  # loop d writes and reads plane d - 1
    completes_prompt: bool  # sample the first output token from the last position
    sampling: SamplingInfo


@dataclass(slots=True)
class PageTableUpdate:
    """Entries [start, start + len(page_ids)) of (slot, plane)'s device page table."""

    slot: int
    plane: int
    start: int
    page_ids: list[int]


@dataclass(slots=True)
class KVCopy:
    """Copy one token's K/V (all layers) from a flat slot to others (copy-on-exit, `full`)."""

    source: int
    destinations: list[int]


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    decode_rows: list[DecodeRow] = field(default_factory=list)
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    page_updates: list[PageTableUpdate] = field(default_factory=list)
    # Slots whose page tables must be reset to the null page (their request left).
    cleared_slots: list[int] = field(default_factory=list)
    # Applied before this step's forward passes.
    kv_copies: list[KVCopy] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decode_rows and not self.prefill_chunks

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decode_rows) + sum(len(c.token_ids) for c in self.prefill_chunks)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class RunnerOutput:
    # Per decode row, in SchedulerOutput order:
    exited: list[bool]
    survival: list[float]  # Π(1 − λ) including this loop (unchanged when not evaluated)
    exit_test: list[bool]  # the exit test held after this loop
    decode_tokens: list[SampledToken | None]  # the next token of rows that exited
    # Per prefill chunk: the first output token of chunks that completed their prompt.
    prefill_tokens: list[SampledToken | None]
