"""The contracts between the scheduler and the model runner, in plain ints and floats.

Owns: `SchedulerOutput` (what one engine step runs) and `RunnerOutput` (what it produced).
Must not: import torch. The scheduler fills the first, the runner the second, and neither reaches
into the other's state.

A step has two parts. Prompt chunks (`PrefillChunk`) run every loop and are chosen by the
scheduler. Decoding is the runner's decode step: every request past its prompt holds a *slot*,
and each step runs one loop for every slot, decides exits and samples, with no host round trip.
The scheduler only starts a slot (`SlotStart`, once the prompt's first token is sampled) and
stops it (`slot_stops`: a stop string, an abort, a finish the step already made); it learns what
the step did from `DecodeResult`, one step late when scheduling is asynchronous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.outputs import TokenLogprobs
from loopserve.sampling_params import ResolvedParams, SamplingInfo


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
    # A constrained request's first token: its bitmask (`TokenMask.words`), None when free.
    token_mask: bytes | None = None
    # A replay after a recompute preemption (`Request.replay_loops`): each position's loops,
    # None when every position runs `num_loops`; the chunk that completes a replay samples
    # nothing and hands the request's in-flight token back to the decode step.
    token_loops: tuple[int, ...] | None = None
    completes_replay: bool = False


@dataclass(slots=True)
class PageTableUpdate:
    """Entries [start, start + len(page_ids)) of (slot, plane)'s device page table."""

    slot: int
    plane: int
    start: int
    page_ids: list[int]


@dataclass(slots=True)
class PageMove:
    """Whole pages of one request between the device cache and host memory (preemption): the
    K/V of `page_ids` (every plane's pages, plane by plane) are saved under `request_id`, or
    written back into them."""

    request_id: str
    page_ids: list[int]


@dataclass(frozen=True, slots=True)
class SlotStart:
    """Hand a request's in-flight token to the decode step, which from then on runs its loops,
    decides its exits, samples its tokens and stops it on a stop token id or `max_tokens`."""

    slot: int
    token: int  # the newest output token, now in flight at loop 1
    position: int  # its position
    num_output_tokens: int  # tokens generated so far (the next one sampled gets this index)
    params: ResolvedParams


@dataclass(frozen=True, slots=True)
class TokenMask:
    """The tokens a constrained request's output `index` may be, for the decode step's slot
    (structured outputs): a bitmask, bit t of little-endian int32 word t // 32 set when token t is
    allowed. `words` None: the constraint has not begun; it begins once `begin_after` (a token
    id, -1 for none) is sampled, and that row's next exit then waits for its bitmask."""

    slot: int
    index: int
    words: bytes | None
    begin_after: int = -1


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    # Applied first: the K/V of preempted requests go to host memory before their pages are reused.
    swap_out: list[PageMove] = field(default_factory=list)
    # Applied after the page-table updates: resumed requests' K/V come back into new pages.
    swap_in: list[PageMove] = field(default_factory=list)
    # Saved K/V of requests that were aborted while preempted: forget them.
    dropped_swaps: list[str] = field(default_factory=list)
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    page_updates: list[PageTableUpdate] = field(default_factory=list)
    # Slots whose page tables must be reset to the null page (their request left).
    cleared_slots: list[int] = field(default_factory=list)
    # Applied in this order before the decode step: stops, then starts.
    slot_stops: list[int] = field(default_factory=list)
    slot_starts: list[SlotStart] = field(default_factory=list)
    # Every slot live in this step's decode step and the request it holds (to attribute results).
    decode_slots: dict[int, str] = field(default_factory=dict)
    # Applied after the starts: bitmasks of constrained slots that started or learned a token.
    token_masks: list[TokenMask] = field(default_factory=list)
    # Speculation (`speculative_config`): whether this step's slots are a speculating decode
    # step's (its lanes) or the plain one's, and whether the other one is emptied first (the
    # mode switched: every decoding request's token is started again in this one).
    speculate: bool = False
    switched: bool = False

    @property
    def runs_decode(self) -> bool:
        return bool(self.decode_slots)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do, not even bookkeeping (a stop, a cleared table)."""
        return not (
            self.prefill_chunks
            or self.decode_slots
            or self.swap_out
            or self.swap_in
            or self.dropped_swaps
            or self.page_updates
            or self.cleared_slots
            or self.slot_stops
            or self.slot_starts
            or self.token_masks
        )


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class DecodeResult:
    """What one decode step did: per decode row (a slot's rows together, one per slot unless
    requests speculate), whether it ran a loop and which; per slot 0..rows-1, the tokens that
    became final, in order, with their exit depths (at most one without speculation)."""

    ran: list[bool]  # per decode row: it ran a loop this step
    loops: list[int]  # per decode row: the loop it ran
    tokens: list[list[SampledToken]]  # per slot
    depths: list[list[int]]  # per slot: each token's exit depth
    stopped: list[bool]  # per slot: the step ended it (stop token id or max_tokens)
    proposed: int = 0  # speculation: proposed tokens that got a decode row this step
    confirmed: int = 0  # speculation: proposed tokens found equal to the final token this step


@dataclass(slots=True)
class RunnerOutput:
    # Per prefill chunk: the first output token of chunks that completed their prompt.
    prefill_tokens: list[SampledToken | None]
    decode: DecodeResult | None = None
