"""`POST /v1/chat/completions`: messages -> the assistant's reply, streamed or not.

Owns: turning the body into choice plans on a worker thread (JSON, fields, limits, the messages'
size, rendering them with the chat template, the rendered prompt's size, then tokenizing: cheap
checks before costly work), and writing the chat response and its chunks (a first `role` delta
per choice, content deltas, chat log-probs, `exit_depths`, usage). Must not: touch the engine
except through `serving.respond`.
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
from loopserve.entrypoints.openai.chat_template import ChatTemplateError
from loopserve.entrypoints.openai.choice_state import ChoiceDelta
from loopserve.entrypoints.openai.constraints import request_constraint
from loopserve.entrypoints.openai.context import ServingContext
from loopserve.entrypoints.openai.errors import bad_request
from loopserve.entrypoints.openai.generation import Generation
from loopserve.entrypoints.openai.prompts import (
    ChoiceOptions,
    ChoicePlan,
    Prompt,
    plan_choices,
    stop_ids,
    tokenize_chat_prompt,
)
from loopserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, parse_request
from loopserve.entrypoints.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
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
from loopserve.entrypoints.reasoning import (
    ReasoningSplitter,
    after_reasoning,
    opens_reasoning,
    split_reasoning,
)
from loopserve.entrypoints.tool_calls import ToolCallStreamer, parse_tool_calls
from loopserve.outputs import RequestOutput, TokenLogprobs, ToolCall


async def create_chat_completion(request: Request, context: ServingContext) -> Response:
    body = await read_body(request, context.config.max_request_bytes)
    prepared = await context.off_loop(_prepare, body, context)
    writer = _ChatWriter(prepared, context)
    constraint = prepared.constraint_field
    return await respond(
        request, context.engine, prepared.plans, prepared.chat.stream, writer, constraint
    )


@dataclass(frozen=True, slots=True)
class _Prepared:
    identity: ResponseIdentity
    chat: ChatCompletionRequest
    plans: list[ChoicePlan]
    # With a reasoning parser: whether replies start inside the reasoning; None: no parser.
    in_reasoning: bool | None
    calls_tools: bool  # replies are parsed for tool calls
    constraint_field: str | None  # the request field that constrains the output


def _prepare(body: bytes, context: ServingContext) -> _Prepared:
    """Body -> choice plans (on a worker thread); a 4xx OpenAIError for anything bad."""
    chat = parse_request(ChatCompletionRequest, parse_json_body(body, context.body_limits))
    identity = ResponseIdentity(
        f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), context.served_name(chat.model)
    )
    limits = context.limits
    limits.check_choices(1, chat.n)
    limits.check_stop(chat.stop_strings, stop_ids(chat, context.model))
    limits.check_logprobs(chat.num_logprobs, "top_logprobs")
    constraint = request_constraint(chat)
    field, params = (None, None) if constraint is None else (constraint.field, constraint.params)
    if chat.tools and not context.parses_tool_calls:
        raise bad_request(
            "this server parses no tool calls (its chat template writes no <tool_call>, or it "
            "runs --tool-call-parser none); start it with --tool-call-parser hermes",
            "tools",
        )
    prompt, text = _chat_prompt(chat, context)
    in_reasoning = opens_reasoning(text) if context.splits_reasoning else None
    options = ChoiceOptions(chat.output_limit, chat.num_logprobs, "messages")
    plans = plan_choices(
        identity.id,
        [prompt],
        chat,
        options,
        context.model.max_model_len,
        context.model.sampling_defaults,
        after_reasoning(params, in_reasoning),
    )
    return _Prepared(identity, chat, plans, in_reasoning, chat.calls_tools, field)


def _chat_prompt(chat: ChatCompletionRequest, context: ServingContext) -> tuple[Prompt, str]:
    """Render and tokenize, each after checking the size of its input; (prompt, its text)."""
    if context.chat_template is None:
        raise bad_request(
            "this model has no chat template (no chat_template in its tokenizer_config.json); "
            "start the server with --chat-template FILE, or use /v1/completions",
            "messages",
        )
    messages = [_message_dict(item) for item in chat.messages]
    context.limits.check_prompt_bytes("".join(item["content"] for item in messages), "messages")
    tools = [tool.model_dump(exclude_none=True) for tool in chat.tools or ()]
    try:
        text = context.chat_template.render(
            messages,
            chat.add_generation_prompt,
            chat.chat_template_kwargs,
            tools if chat.calls_tools else None,
        )
    except ChatTemplateError as error:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(error) else "messages"
        raise bad_request(str(error), param) from None
    return tokenize_chat_prompt(text, context.model, context.limits), text


def _message_dict(item: ChatMessage) -> dict[str, Any]:
    """A message as the template sees it: role, content, and the fields that are set of `name`,
    `tool_calls` (an assistant turn that called tools) and `tool_call_id` (a tool's answer)."""
    message: dict[str, Any] = {"role": item.role, "content": item.text()}
    for name in ("name", "tool_calls", "tool_call_id"):
        if getattr(item, name) is not None:
            message[name] = getattr(item, name)
    return message


class _ChatWriter:
    def __init__(self, prepared: _Prepared, context: ServingContext) -> None:
        self._identity = prepared.identity
        self._plans: Sequence[ChoicePlan] = prepared.plans
        self._request = prepared.chat
        self._context = context
        self._in_reasoning = prepared.in_reasoning
        self._calls_tools = prepared.calls_tools
        # Streams: each choice's reasoning splitter and tool-call streamer, and its calls so far.
        indices = [plan.index for plan in self._plans]
        in_reasoning = self._in_reasoning
        self._splitters = (
            {} if in_reasoning is None else {i: ReasoningSplitter(in_reasoning) for i in indices}
        )
        self._streamers = {i: ToolCallStreamer() for i in indices} if self._calls_tools else {}
        self._num_calls = dict.fromkeys(indices, 0)

    def response(self, outputs: Mapping[str, RequestOutput]) -> dict[str, Any]:
        with_ids = self._request.return_token_ids
        choices = []
        for plan in self._plans:
            output = outputs[plan.request.request_id].outputs[0]
            reasoning, content = None, output.text
            if self._in_reasoning is not None:
                reasoning, content = split_reasoning(output.text, self._in_reasoning)
            calls: list[ToolCall] = []
            if self._calls_tools:
                content, calls = parse_tool_calls(content)
            message = AssistantMessage(
                content=content if content or not calls else None,
                reasoning_content=reasoning,
                tool_calls=[_tool_call(call) for call in calls] or None,
            )
            choices.append(
                ChatChoice(
                    index=plan.index,
                    message=message,
                    logprobs=self._chat_logprobs(output.logprobs),
                    finish_reason=_finish_reason(output.finish_reason, bool(calls)),
                    stop_reason=output.stop_reason,
                    exit_depths=output.exit_depths,
                    token_ids=output.token_ids if with_ids else None,
                )
            )
        num_tokens = sum(
            len(outputs[plan.request.request_id].outputs[0].token_ids) for plan in self._plans
        )
        response = ChatCompletionResponse(
            id=self._identity.id,
            created=self._identity.created,
            model=self._identity.model,
            choices=choices,
            usage=usage(self._plans, num_tokens),
            prompt_token_ids=self._plans[0].prompt.token_ids if with_ids else None,
        )
        return to_json(response)

    async def events(self, generation: Generation) -> AsyncIterator[bytes]:
        chunk = ChunkEvents(self._chunk([]))
        role = ChatDelta(role="assistant", content="")
        yield b"".join(
            chunk.event([ChatChunkChoice(index=plan.index, delta=role, exit_depths=[])])
            for plan in self._plans
        )
        num_tokens = 0
        async for deltas in choice_deltas(generation, self._plans):
            events = []
            for plan, delta in deltas:
                num_tokens += len(delta.token_ids)
                events.append(chunk.event([self._chunk_choice(plan, delta)]))
            if events:
                yield b"".join(events)
        if self._request.include_usage_in_stream:
            yield sse_model_event(self._chunk([], usage_counts=usage(self._plans, num_tokens)))

    def _chunk_choice(self, plan: ChoicePlan, delta: ChoiceDelta) -> ChatChunkChoice:
        text_delta = self._text_delta(plan, delta)
        called = self._num_calls[plan.index] > 0
        return ChatChunkChoice(
            index=plan.index,
            delta=text_delta,
            logprobs=self._chat_logprobs(delta.logprobs),
            finish_reason=_finish_reason(delta.finish_reason, called),
            stop_reason=delta.stop_reason,
            exit_depths=delta.exit_depths,
            token_ids=delta.token_ids if self._request.return_token_ids else None,
        )

    def _text_delta(self, plan: ChoicePlan, delta: ChoiceDelta) -> ChatDelta:
        """The delta's text, split into reasoning and content where a reasoning parser runs."""
        if self._in_reasoning is None and not self._calls_tools:
            return ChatDelta(content=delta.text)
        done = delta.finish_reason is not None
        reasoning, content = "", delta.text
        if self._in_reasoning is not None:
            splitter = self._splitters[plan.index]
            reasoning, content = splitter.feed(delta.text)
            if done:
                held_reasoning, held_content = splitter.finish()
                reasoning, content = reasoning + held_reasoning, content + held_content
        calls: list[DeltaToolCall] = []
        if self._calls_tools:
            streamer = self._streamers[plan.index]
            content, found = streamer.feed(content)
            if done:
                held_content, more = streamer.finish()
                content, found = content + held_content, found + more
            first = self._num_calls[plan.index]
            self._num_calls[plan.index] = first + len(found)
            calls = [
                DeltaToolCall(index=first + i, **_tool_call(call).model_dump())
                for i, call in enumerate(found)
            ]
        return ChatDelta(
            content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None
        )

    def _chat_logprobs(self, entries: list[TokenLogprobs] | None) -> ChatLogprobs | None:
        return self._context.logprobs.chat(entries) if entries is not None else None

    def _chunk(
        self, choices: list[ChatChunkChoice], usage_counts: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._identity.id,
            created=self._identity.created,
            model=self._identity.model,
            choices=choices,
            usage=usage_counts,
        )


def _tool_call(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` where a reply that made calls ended on its own (not by length)."""
    return "tool_calls" if called and reason == "stop" else reason
