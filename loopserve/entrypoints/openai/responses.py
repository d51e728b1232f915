"""Response bodies of the OpenAI API, as pydantic models (what clients receive).

Owns: the shapes of completions, chat completions, their streamed chunks, usage, log-probs and
the model list. Must not: compute anything (serving code fills them in).

Extension: every choice carries `exit_depths`, the number of loops each of its generated tokens
ran (for a streamed chunk: the tokens generated since the previous chunk of that choice). With
`return_token_ids`, choices carry `token_ids` and the prompt's `prompt_token_ids` (as in vLLM).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    exit_depths: list[int]
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCallOut):
    index: int  # the call's place among the choice's calls


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with a reasoning parser: the text inside <think>
    tool_calls: list[ToolCallOut] | None = None  # with tools and a tool-call parser


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    exit_depths: list[int]
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    exit_depths: list[int]
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loopserve"
    root: str
    max_model_len: int
    # Ouro: loops of the shared stack at full depth.
    num_loops: int
    # How the engine runs it: activations' dtype, how K/V are stored, how the weights are.
    dtype: str
    kv_cache_dtype: str
    # fp8 K/V: where the per-layer scales came from ("1.0", "calculated", "checkpoint"); null
    # where K/V are not fp8.
    kv_cache_scales: str | None = None
    quantization: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def to_json(model: BaseModel) -> dict[str, Any]:
    """A response model as plain JSON data (None fields kept, as OpenAI sends them)."""
    return model.model_dump(mode="json")
