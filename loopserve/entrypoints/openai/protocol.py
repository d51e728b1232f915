"""Request bodies of the OpenAI API, as pydantic models (what clients may send).

Owns: the fields of `/v1/completions` and `/v1/chat/completions`, their types and ranges, the
vLLM and Ouro extensions, rejecting OpenAI fields this server does not implement, and the 400 that
names the first bad field. Types are strict: a bool is not a number, an integer field takes JSON
integers only, a string field strings only. Validation stops at the first bad item of a list, and
prompts are checked without trying each form item by item, so a long bad list costs no more than a
good one. A chat message has a known role (system, user, assistant, tool, developer) and content,
which only an assistant message with tool_calls may leave out. Must not: know about the engine
(serving code turns these into `SamplingParams`).

Extensions beyond OpenAI: `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, `return_token_ids`, `chat_template_kwargs`, `priority` (as in vLLM), and
the loop depth
of each generated token: `min_loops`, `max_loops`, `exit_threshold`. Unknown fields are ignored, as
in vLLM. Sampling fields left unset (None) take the checkpoint's generation_config.json defaults,
then `SamplingParams`' (serving code fills them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from loopserve.entrypoints.openai.errors import OpenAIError, bad_request

# OpenAI fields accepted only at their no-op value: field -> what "not used" looks like.
_UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
}


_Request = TypeVar("_Request", bound="GenerationFields")
PromptInput = str | list[str] | list[int] | list[list[int]]
_PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of token-id lists"
# Pydantic's names for the members of a union in an error's location (`prompt.list[int].0`).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class GenerationFields(_Model):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None: the checkpoint's generation_config.json default, else SamplingParams'.
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions.
    stop_token_ids: list[int] = Field(default_factory=list, fail_fast=True)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    # Scheduling priority (as in vLLM): lower goes first.
    priority: int = 0
    # Ouro extensions: loop depth of each generated token.
    min_loops: int = 1
    max_loops: int | None = None
    exit_threshold: float | None = None
    # Rejected unless neutral (see _UNSUPPORTED_UNLESS_NEUTRAL), whatever their type.
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    # Constrained decoding (vLLM's fields), read by `constraints.request_constraint`.
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        """Clients send `null` for "not set" (OpenAI allows it): the default applies."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _check_stream_options(self) -> GenerationFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given when stream is true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: PromptInput
    echo: bool = False
    # Log-probabilities of the sampled token and this many alternatives (at most --max-logprobs).
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = None
    suffix: Any = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt_form(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> PromptInput:
        """At C speed, instead of pydantic trying each form of the union item by item."""
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            kinds = set(map(type, value))
            if kinds == {str} or kinds == {int}:
                return value
            if kinds == {list} and all(set(map(type, item)) <= {int} for item in value):
                return value
        raise ValueError(f"the prompt must be {_PROMPT_FORMS} (and not empty)")

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (leave it unset or equal to n)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs prompt log-probabilities, not supported")
        return self


class TextPart(_Model):
    type: Literal["text"]
    text: str


ChatRole = Literal["system", "user", "assistant", "tool", "developer"]


class ChatMessage(_Model):
    """One message: `content` is required, except in an assistant message with `tool_calls`."""

    role: ChatRole
    # Accepted so that an assistant turn that called tools may leave `content` out; not rendered.
    tool_calls: Annotated[list[dict[str, Any]], Field(fail_fast=True)] | None = None
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = Field(
        default=None, validate_default=True
    )
    name: str | None = None
    tool_call_id: str | None = None  # a `tool` message: the call it answers

    @field_validator("content", mode="after")
    @classmethod
    def _content_is_required(cls, content: Any, info: ValidationInfo) -> Any:
        if content is not None or "role" not in info.data:  # a bad role is reported instead
            return content
        if info.data["role"] == "assistant" and info.data.get("tool_calls"):
            return content
        raise ValueError(
            "content is required (a string or a list of text parts), except in an assistant "
            "message with tool_calls"
        )

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines (as in vLLM)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionSpec(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments


class ToolSpec(_Model):
    type: Literal["function"]
    function: FunctionSpec


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1, fail_fast=True)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    # Alternatives per token (at most --max-logprobs).
    top_logprobs: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    # Extra variables for the chat template (vLLM's extension), e.g. {"enable_thinking": true}.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolSpec], Field(fail_fast=True)] | None = None
    # "auto" (the default with tools), "none", "required" or a named function (the last two
    # constrain the reply to tool calls: `constraints.request_constraint`).
    tool_choice: str | dict[str, Any] | None = None
    # False: a reply to tool_choice "required" is exactly one call (with "auto" nothing counts
    # the calls a model writes).
    parallel_tool_calls: bool = True
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self

    @property
    def calls_tools(self) -> bool:
        """The request offers tools and lets the model call them."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def output_limit(self) -> int | None:
        """max_completion_tokens (the current OpenAI name) or else max_tokens."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_request(model: type[_Request], body: Any) -> _Request:
    """Validate a JSON body into `model`; raises a 400 OpenAIError naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as error:
        raise _validation_error(error) from None
    for name, neutral in _UNSUPPORTED_UNLESS_NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise bad_request(f"{name} is not supported by this server", param=name)
    return request


def field_named_in(message: str) -> str | None:
    """The request field an error message starts with (`top_p must be ...`, `stop[1] must ...`,
    `structured_outputs.regex: ...`), as `SamplingParams` and engine errors do; None when it
    starts with something else."""
    first = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0].rstrip(":")
    return first if first in _FIELDS else None


def _validation_error(error: ValidationError) -> OpenAIError:
    errors = error.errors()
    first = errors[0]["loc"]
    # Up to the first union member's name: the field itself (`prompt`, not `prompt.list[int].0`).
    cut = next((index for index, part in enumerate(first) if _is_type_tag(part)), len(first))
    param = ".".join(str(part) for part in first[:cut]) or None
    message = errors[0]["msg"].removeprefix("Value error, ")
    if cut < len(first):
        same_field = [item["loc"] for item in errors if item["loc"][:cut] == first[:cut]]
        tried = sorted({str(loc[cut]) for loc in same_field if len(loc) > cut})
        message = f"matches none of the accepted forms ({', '.join(tried)}): {message}"
    elif len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{message}", param=param)


def _is_type_tag(part: str | int) -> bool:
    """Whether a location part names a union member rather than a field (`list[int]`, `str`)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper())


_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)
