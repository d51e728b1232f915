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


@dataclass(frozen=True, slots=True)
class SlotSetup:
    """Device decode mode: hand a request's in-flight token to the device-resident decoder.

    From then on the device runs one loop per step for the slot, decides exits, samples, and stops
    the slot on an end-of-sequence id, a stop token id or max_tokens, all without the host.
    """

    slot: int
    token: int  # the first output token, now in flight at loop 1
    position: int  # its position (= the number of prompt tokens)
    min_loops: int
    max_loops: int
    exit_threshold: float
    gate_mode: int  # GATE_FIXED, GATE_OURO, GATE_DELAYED or GATE_TRACE
    max_tokens: int
    stop_token_ids: tuple[int, ...]  # end-of-sequence ids and the request's stop ids
    trace_depths: tuple[int, ...]  # trace mode: depth of each decode computation, else empty
    sampling: SamplingInfo  # output_index = 1: the next token sampled is the second output


# SlotSetup.gate_mode values.
GATE_FIXED, GATE_OURO, GATE_DELAYED, GATE_TRACE = 0, 1, 2, 3


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
    # Device decode mode: slots to start and to stop before the slot step, whether to run it, and
    # which request each slot holds during this step (to attribute its results).
    slot_setups: list[SlotSetup] = field(default_factory=list)
    slot_stops: list[int] = field(default_factory=list)
    run_slot_step: bool = False
    slot_requests: dict[int, str] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.decode_rows and not self.prefill_chunks and not self.run_slot_step

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decode_rows) + sum(len(c.token_ids) for c in self.prefill_chunks)


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class SlotStepResult:
    """What one device-resident decode step did, per slot row 0..rows-1."""

    ran: list[bool]  # the slot ran a loop this step
    loops: list[int]  # the loop it ran
    exited: list[bool]
    tokens: list[SampledToken | None]  # the sampled next token of slots that exited
    stopped: list[bool]  # the device ended the slot (stop id or max_tokens) after this token


@dataclass(slots=True)
class RunnerOutput:
    # Per decode row, in SchedulerOutput order:
    exited: list[bool]
    survival: list[float]  # Π(1 − λ) including this loop (unchanged when not evaluated)
    exit_test: list[bool]  # the exit test held after this loop
    decode_tokens: list[SampledToken | None]  # the next token of rows that exited
    # Per prefill chunk: the first output token of chunks that completed their prompt.
    prefill_tokens: list[SampledToken | None]
    slot_step: SlotStepResult | None = None
