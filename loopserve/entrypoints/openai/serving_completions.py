"""`POST /v1/completions`: prompts (text, texts, token ids) -> completions, streamed or not.

Owns: turning the body into choice plans on a worker thread (JSON, fields, limits, then
tokenizing: cheap checks before costly work) and writing the completions response and its chunks
(echo, log-probs with text offsets, `exit_depths`, usage). Must not: touch the engine except
through `serving.respond`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from loopserve.entrypoints.openai.body import parse_json_body, read_body
from loopserve.entrypoints.openai.choice_state import ChoiceDelta
from loopserve.entrypoints.openai.constraints import request_constraint
from loopserve.entrypoints.openai.context import ServingContext
from loopserve.entrypoints.openai.generation import Generation
from loopserve.entrypoints.openai.prompts import (
    ChoiceOptions,
    ChoicePlan,
    plan_choices,
    prompt_batch,
    stop_ids,
    tokenize_prompts,
)
from loopserve.entrypoints.openai.protocol import CompletionRequest, parse_request
from loopserve.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionResponse,
    Usage,
    to_json,
)
from loopserve.entrypoints.openai.serving import (
    ChunkEvents,
    ResponseIdentity,
    choice_deltas,
    respond,
    usage,
)
from loopserve.entrypoints.openai.streaming import sse_model_event
from loopserve.outputs import RequestOutput


async def create_completion(request: Request, context: ServingContext) -> Response:
    body = await read_body(request, context.config.max_request_bytes)
    prepared = await context.off_loop(_prepare, body, context)
    writer = _CompletionWriter(prepared.identity, prepared.plans, prepared.completion, context)
    return await respond(
        request,
        context.engine,
        prepared.plans,
        prepared.completion.stream,
        writer,
        prepared.constraint_field,
    )


@dataclass(frozen=True, slots=True)
class _Prepared:
    identity: ResponseIdentity
    completion: CompletionRequest
    plans: list[ChoicePlan]
    constraint_field: str | None  # the request field that constrains the output


def _prepare(body: bytes, context: ServingContext) -> _Prepared:
    """Body -> choice plans (on a worker thread); a 4xx OpenAIError for anything bad."""
    completion = parse_request(CompletionRequest, parse_json_body(body, context.body_limits))
    identity = ResponseIdentity(
        f"cmpl-{uuid.uuid4().hex}", int(time.time()), context.served_name(completion.model)
    )
    batch = prompt_batch(completion.prompt)
    limits = context.limits
    limits.check_choices(len(batch), completion.n)
    limits.check_stop(completion.stop_strings, stop_ids(completion, context.model))
    limits.check_logprobs(completion.logprobs, "logprobs")
    constraint = request_constraint(completion)
    field, params = (None, None) if constraint is None else (constraint.field, constraint.params)
    prompts = tokenize_prompts(batch, context.model, limits, keep_text=completion.echo)
    options = ChoiceOptions(completion.max_tokens, completion.logprobs, "prompt")
    plans = plan_choices(
        identity.id,
        prompts,
        completion,
        options,
        context.model.max_model_len,
        context.model.sampling_defaults,
        params,
    )
    return _Prepared(identity, completion, plans, field)


class _CompletionWriter:
    def __init__(
        self,
        identity: ResponseIdentity,
        plans: Sequence[ChoicePlan],
        request: CompletionRequest,
        context: ServingContext,
    ) -> None:
        self._identity = identity
        self._plans = plans
        self._request = request
        self._context = context

    def response(self, outputs: Mapping[str, RequestOutput]) -> dict[str, Any]:
        choices = []
        for plan in self._plans:
            output = outputs[plan.request.request_id].outputs[0]
            echo = self._echo(plan)
            delta = ChoiceDelta(
                text=echo + output.text,
                token_ids=output.token_ids,
                exit_depths=output.exit_depths,
                logprobs=output.logprobs,
                finish_reason=output.finish_reason,
                stop_reason=output.stop_reason,
            )
            choices.append(self._choice(plan, delta, len(echo))[0])
        num_tokens = sum(
            len(outputs[plan.request.request_id].outputs[0].token_ids) for plan in self._plans
        )
        return to_json(self._body(choices, usage(self._plans, num_tokens)))

    async def events(self, generation: Generation) -> AsyncIterator[bytes]:
        chunk = ChunkEvents(self._body([]))
        offsets = {plan.index: 0 for plan in self._plans}
        if self._request.echo:
            echoes = []
            for plan in self._plans:
                echo = self._echo(plan)
                offsets[plan.index] = len(echo)
                echoes.append(chunk.event([_text_choice(plan.index, echo)]))
            yield b"".join(echoes)
        num_tokens = 0
        async for deltas in choice_deltas(generation, self._plans):
            events = []
            for plan, delta in deltas:
                choice, offsets[plan.index] = self._choice(plan, delta, offsets[plan.index])
                num_tokens += len(delta.token_ids)
                events.append(chunk.event([choice]))
            if events:
                yield b"".join(events)
        if self._request.include_usage_in_stream:
            yield sse_model_event(self._body([], usage(self._plans, num_tokens)))

    def _choice(
        self, plan: ChoicePlan, delta: ChoiceDelta, text_offset: int
    ) -> tuple[CompletionChoice, int]:
        logprobs = None
        if delta.logprobs is not None:
            logprobs, text_offset = self._context.logprobs.completion(delta.logprobs, text_offset)
        with_ids = self._request.return_token_ids
        choice = CompletionChoice(
            index=plan.index,
            text=delta.text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            exit_depths=delta.exit_depths,
            token_ids=delta.token_ids if with_ids else None,
            prompt_token_ids=plan.prompt.token_ids if with_ids else None,
        )
        return choice, text_offset

    def _echo(self, plan: ChoicePlan) -> str:
        return (plan.prompt.text or "") if self._request.echo else ""

    def _body(
        self, choices: list[CompletionChoice], usage_counts: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self._identity.id,
            created=self._identity.created,
            model=self._identity.model,
            choices=choices,
            usage=usage_counts,
        )


def _text_choice(index: int, text: str) -> CompletionChoice:
    return CompletionChoice(index=index, text=text, exit_depths=[])
