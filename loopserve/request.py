"""A request as the scheduler sees it: prompt, progress, and the state of its in-flight token.

Owns: `Request` and its derived positions. Must not: import torch.

Lifecycle: WAITING -> RUNNING (admitted: a slot and KV pages) -> FINISHED, with RUNNING -> WAITING
when it is preempted (its K/V go to host memory and come back when it is admitted again, or are
dropped and recomputed: `num_replay_tokens`). While
RUNNING a request first prefills its prompt in chunks (`num_computed_tokens` chases
`num_prompt_tokens`), then decodes: its newest output token is *in flight* in the decode step,
which runs it loop by loop until it exits and the coda samples the next token (the host does not
track its loops).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from loopserve.outputs import RequestMetrics, TokenLogprobs
from loopserve.sampling_params import ResolvedParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: ResolvedParams
    metrics: RequestMetrics
    prompt: str | None = None
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Prefill positions whose K/V exist (the prompt's at every loop).
    num_computed_tokens: int = 0
    # After a recompute preemption: generated tokens (all but the in-flight one) whose K/V are
    # computed again after the prompt's, each to its own exit depth, before decoding resumes.
    num_replay_tokens: int = 0
    slot: int | None = None
    # Scheduling bookkeeping: the order of arrival, how often later requests went first, the
    # prompt's chained block hashes (prefix caching), and while preempted, the pages per plane
    # its K/V hold in host memory.
    arrival_index: int = 0
    times_bypassed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    swapped_pages: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """Past its prompt and not finished: its in-flight token is in the decode step."""
        return not self.is_prefilling and self.status is RequestStatus.RUNNING

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def num_prefill_tokens(self) -> int:
        """Positions computed before decoding: the prompt, plus any replayed tokens."""
        return self.num_prompt_tokens + self.num_replay_tokens

    def prefill_token_ids(self, start: int, end: int) -> list[int]:
        """The input tokens of prefill positions [start, end): prompt, then replayed outputs."""
        prompt = self.num_prompt_tokens
        tokens = self.prompt_token_ids[start:end]
        if end > prompt:
            tokens += self.output_token_ids[max(start, prompt) - prompt : end - prompt]
        return tokens

    def replay_loops(self, start: int, end: int) -> tuple[int, ...] | None:
        """Loops of each prefill position in [start, end) when some is a replayed token (the
        loops its successor exited after), None when all are prompt positions (every loop)."""
        prompt = self.num_prompt_tokens
        if end <= prompt:
            return None
        full = self.params.max_loops
        return tuple(
            full if position < prompt else self.exit_depths[position - prompt + 1]
            for position in range(start, end)
        )

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def position(self) -> int:
        """Position of the in-flight token (the newest output token)."""
        return self.num_prompt_tokens + self.num_output_tokens - 1
