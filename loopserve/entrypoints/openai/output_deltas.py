"""Engine outputs across a process boundary, as what each step added to them.

Owns: `DeltaEncoder` (the engine's side: a step's `RequestOutput`s to `OutputDelta`s, remembering
what each request has sent) and `DeltaDecoder` (the other side: deltas back to `RequestOutput`s
equal to the engine's, the cumulative fields rebuilt). Must not: import torch or the engine.

Why: an `Engine.step` output carries its request's whole state (generated token ids, exit depths,
logprobs, text, token times), so pickling it costs time in proportion to the tokens so far (14 µs
for an output of ~75 tokens on the CPU box, several milliseconds a step for 128 long requests),
while a step adds a token or a few. A delta carries what was added; the text as the length of
what is kept plus what follows (a stop string may cut text already sent, and generated tokens
when a step added several). `Engine.step` gives one sequence per output (`n` is merged above it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from loopserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs


class RequestStart(NamedTuple):
    """What a request's first delta carries once: its prompt and arrival."""

    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float


class OutputDelta(NamedTuple):
    """What one `RequestOutput` added since the request's last one (a tuple: the cheapest thing
    to build and pickle, 19 fields for every output of every step)."""

    request_id: str
    start: RequestStart | None  # on the request's first delta only
    tokens_kept: int  # generated tokens kept of those sent before (fewer where a stop cut some)
    token_ids: list[int]  # then these (and their exit depths and logprobs)
    exit_depths: list[int]
    logprobs: list[TokenLogprobs] | None  # None: the request asked for none
    times_kept: int  # token times kept, then these
    token_times: list[float]
    text_kept: int  # characters of the text sent before that are kept, then `text`
    text: str
    finished: bool
    # The rest of `CompletionOutput` and `RequestMetrics`, as they are now.
    finish_reason: str | None
    stop_reason: str | int | None
    new_token_ids: list[int]
    new_text: str
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass(slots=True)
class _Sent:
    tokens: int = 0
    times: int = 0
    text: str = ""


class DeltaEncoder:
    """The engine's side. Forgets a request once its finished output is encoded."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, outputs: list[RequestOutput]) -> list[OutputDelta]:
        return [self._encode(output) for output in outputs]

    def _encode(self, output: RequestOutput) -> OutputDelta:
        (sequence,) = output.outputs
        if sequence.reasoning_content is not None or sequence.tool_calls is not None:
            raise ValueError("an engine step's output has no reasoning or tool calls to send")
        sent = self._sent.get(output.request_id)
        start = None
        if sent is None:
            sent = self._sent[output.request_id] = _Sent()
            times = output.metrics
            start = RequestStart(output.prompt, output.prompt_token_ids, times.arrival_time)
        tokens_kept = min(sent.tokens, len(sequence.token_ids))
        times_kept = min(sent.times, len(output.metrics.token_times))
        text_kept = _common_prefix(sent.text, sequence.text)
        metrics = output.metrics
        delta = OutputDelta(
            request_id=output.request_id,
            start=start,
            tokens_kept=tokens_kept,
            token_ids=sequence.token_ids[tokens_kept:],
            exit_depths=sequence.exit_depths[tokens_kept:],
            logprobs=None if sequence.logprobs is None else sequence.logprobs[tokens_kept:],
            times_kept=times_kept,
            token_times=metrics.token_times[times_kept:],
            text_kept=text_kept,
            text=sequence.text[text_kept:],
            finished=output.finished,
            finish_reason=sequence.finish_reason,
            stop_reason=sequence.stop_reason,
            new_token_ids=sequence.new_token_ids,
            new_text=sequence.new_text,
            first_scheduled_time=metrics.first_scheduled_time,
            first_token_time=metrics.first_token_time,
            finished_time=metrics.finished_time,
        )
        if output.finished:
            del self._sent[output.request_id]
        else:
            sent.tokens, sent.times = len(sequence.token_ids), len(metrics.token_times)
            sent.text = sequence.text
        return delta


@dataclass(slots=True)
class _Request:
    start: RequestStart
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""


class DeltaDecoder:
    """The other side: each delta becomes the `RequestOutput` the engine gave (fresh lists, as
    `Engine.step`'s are; one live `RequestMetrics` per request, as the engine's is)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}

    def decode(self, deltas: list[OutputDelta]) -> list[RequestOutput]:
        return [self._decode(delta) for delta in deltas]

    def forget(self, request_ids: list[str]) -> None:
        """Drop requests whose finished output will never come (the engine process died)."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def _decode(self, delta: OutputDelta) -> RequestOutput:
        request = self._requests.get(delta.request_id)
        if request is None:
            if delta.start is None:
                raise ValueError(f"a delta of {delta.request_id!r} came before its first one")
            metrics = RequestMetrics(delta.start.arrival_time)
            request = self._requests[delta.request_id] = _Request(delta.start, metrics)
        kept = delta.tokens_kept
        request.token_ids[kept:] = delta.token_ids
        request.exit_depths[kept:] = delta.exit_depths
        if delta.logprobs is not None:
            request.logprobs[kept:] = delta.logprobs
        request.text = request.text[: delta.text_kept] + delta.text
        metrics = request.metrics
        metrics.token_times[delta.times_kept :] = delta.token_times
        metrics.first_scheduled_time = delta.first_scheduled_time
        metrics.first_token_time = delta.first_token_time
        metrics.finished_time = delta.finished_time
        if delta.finished:
            del self._requests[delta.request_id]
        sequence = CompletionOutput(
            index=0,
            text=request.text,
            token_ids=list(request.token_ids),
            exit_depths=list(request.exit_depths),
            logprobs=None if delta.logprobs is None else list(request.logprobs),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            new_token_ids=delta.new_token_ids,
            new_text=delta.new_text,
        )
        start = request.start
        return RequestOutput(
            request_id=delta.request_id,
            prompt=start.prompt,
            prompt_token_ids=start.prompt_token_ids,
            outputs=[sequence],
            finished=delta.finished,
            metrics=metrics,
        )


def _common_prefix(old: str, new: str) -> int:
    """Characters at the start of `new` that `old` had (all of `old` when `new` extends it)."""
    if new.startswith(old):
        return len(old)
    length = 0
    for a, b in zip(old, new, strict=False):
        if a != b:
            break
        length += 1
    return length
