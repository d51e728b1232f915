"""What the engine streams back for each request.

Owns: `RequestOutput` (a request: its prompt and its sequences), `CompletionOutput` (one sequence:
cumulative state plus this step's delta), `TokenLogprobs` and `RequestMetrics`, in vLLM's shape.
Must not: import torch.
"""

from __future__ import annotations

import uuid
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
class CompletionOutput:
    """One generated sequence of a request (vLLM's `CompletionOutput`, plus the loops each token
    ran). `text`, `token_ids`, `exit_depths` and `logprobs` are cumulative; `text` always equals
    `tokenizer.decode(token_ids)` except where a stop string cut it. `new_token_ids` and `new_text`
    are what the engine step that produced this output added (what a stream sends next)."""

    index: int  # which of the request's `n` sequences this is
    text: str
    token_ids: list[int]
    exit_depths: list[int]  # loops run to produce each generated token
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    # The stop string or stop token that ended the sequence, if one did.
    stop_reason: str | int | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # `LLM.chat` with a reasoning parser: `text` split into its <think> part (None: it had none)
    # and the rest, the tags dropped (docs/server.md, "Reasoning"); None elsewhere.
    reasoning_content: str | None = None
    content: str | None = None
    # `LLM.chat` with tools: the calls parsed out of `content` (which keeps the text around them).
    tool_calls: list[ToolCall] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_exit_depth(self) -> float:
        return sum(self.exit_depths) / len(self.exit_depths) if self.exit_depths else 0.0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call parsed out of a chat reply (`LLM.chat` with tools, the server's `tool_calls`)."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(slots=True)
class RequestOutput:
    """A request's state after an engine step (vLLM's `RequestOutput`): its prompt and one
    `CompletionOutput` per generated sequence. `Engine.step` returns requests of one sequence;
    `LLM.generate` with `n > 1` merges n of them into one output with `n` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool  # every sequence has finished
    metrics: RequestMetrics

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
