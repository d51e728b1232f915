"""What the engine streams back for each request.

Owns: `RequestOutput` (cumulative state plus this step's delta) and `TokenLogprobs`.
Must not: import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probability of one generated token and the most likely alternatives."""

    token_id: int
    logprob: float
    # (token id, logprob) of the top alternatives, most likely first.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """A request's state after an engine step. `token_ids`, `text`, `exit_depths` and `logprobs`
    are cumulative; `new_token_ids` and `new_text` are what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    exit_depths: list[int]  # loops run to produce each generated token
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    new_token_ids: list[int]
    new_text: str
    metrics: RequestMetrics
    # The stop string or stop token that ended the request, if one did.
    stop_reason: str | int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def mean_exit_depth(self) -> float:
        return sum(self.exit_depths) / len(self.exit_depths) if self.exit_depths else 0.0
