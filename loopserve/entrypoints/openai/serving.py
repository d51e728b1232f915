"""The skeleton shared by the generation endpoints: engine requests in, one response out.

Owns: `respond` (start the generation, then stream events or wait for the final outputs while
watching for a disconnect; whatever ends the response aborts what is unfinished), merging a
generation's outputs into per-choice deltas, SSE framing of chunk streams (the events of one batch
of outputs go out in one write; an error after the headers went out becomes an error event), and
usage counts. Must not: know the fields of a
particular endpoint (its `ResponseWriter` does).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loopserve.entrypoints.openai.choice_state import ChoiceDelta, ChoiceState
from loopserve.entrypoints.openai.engine_thread import EngineLink
from loopserve.entrypoints.openai.errors import OpenAIError
from loopserve.entrypoints.openai.generation import Generation
from loopserve.entrypoints.openai.prompts import ChoicePlan
from loopserve.entrypoints.openai.responses import Usage
from loopserve.entrypoints.openai.streaming import (
    DONE_EVENT,
    EventStreamResponse,
    sse_event,
    sse_model_event,
    unless_disconnected,
)
from loopserve.outputs import RequestOutput

# Status logged for a request whose client left before its response (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True, slots=True)
class ResponseIdentity:
    id: str
    created: int  # Unix seconds
    model: str


class ResponseWriter(Protocol):
    def events(self, generation: Generation) -> AsyncIterator[bytes]:
        """The SSE events of a streamed response (`ChunkEvents`), those of one batch of outputs
        in one piece (one write)."""
        ...

    def response(self, outputs: Mapping[str, RequestOutput]) -> dict[str, Any]:
        """The JSON body of a complete response, from each request's final output."""
        ...


async def respond(
    request: Request,
    engine: EngineLink,
    plans: Sequence[ChoicePlan],
    stream: bool,
    writer: ResponseWriter,
    constraint_field: str | None = None,
) -> Response:
    """Run the plans' engine requests and answer with their result (JSON or SSE);
    `constraint_field`: the request field their output constraint came from."""
    generation = Generation(engine, [plan.request for plan in plans], constraint_field)
    await generation.start()
    if stream:
        return EventStreamResponse(_events(writer.events(generation)), on_close=generation.close)
    try:
        outputs = await unless_disconnected(generation.final_outputs(), request.receive)
    finally:
        generation.close()
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(writer.response(outputs))


async def _events(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for piece in events:
            yield piece
    except OpenAIError as error:
        yield sse_event(error.body())
    yield DONE_EVENT


class ChunkEvents:
    """The SSE events of one streamed response's chunks. A chunk of choices without usage (every
    chunk but the usage one) is written as the response's envelope (`id`, `object`, `created`,
    `model`, `"usage":null`), serialized once here, around its choices' JSON: the bytes of
    `sse_model_event` of the whole chunk, at the cost of serializing the choices alone."""

    def __init__(self, envelope: BaseModel) -> None:
        """`envelope`: a chunk of the response with `choices` empty and no usage."""
        head, found, tail = sse_model_event(envelope).partition(b'"choices":[]')
        if not found:
            raise ValueError("the envelope must have an empty `choices` list")
        self._head = head + b'"choices":['
        self._tail = b"]" + tail

    def event(self, choices: Sequence[BaseModel]) -> bytes:
        """The event of the envelope's chunk with these choices."""
        encoded = (choice.model_dump_json(ensure_ascii=True).encode() for choice in choices)
        return self._head + b",".join(encoded) + self._tail


async def choice_deltas(
    generation: Generation, plans: Sequence[ChoicePlan]
) -> AsyncIterator[list[tuple[ChoicePlan, ChoiceDelta]]]:
    """Per-choice deltas as outputs arrive, a list per batch of outputs: one per token an engine
    output adds to a choice, or one that finishes it, in arrival order (so a stream carries an
    event per generated token)."""
    by_id = {plan.request.request_id: plan for plan in plans}
    states = {request_id: ChoiceState() for request_id in by_id}
    async for batch in generation.batches():
        yield [
            (by_id[output.request_id], delta)
            for output in batch
            for delta in states[output.request_id].deltas(output)
        ]


def usage(plans: Sequence[ChoicePlan], completion_tokens: int) -> Usage:
    """Prompt tokens count once per prompt (not per choice), as in vLLM."""
    prompt_lengths = {plan.prompt_index: len(plan.prompt.token_ids) for plan in plans}
    prompt_tokens = sum(prompt_lengths.values())
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
