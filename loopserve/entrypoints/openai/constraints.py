"""What a request's output must match, from its fields: vLLM's `structured_outputs` and
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and on chat OpenAI's
`response_format` (`json_object`, `json_schema`) and `tool_choice` (`required`, a named function).

Owns: reading those fields into one `StructuredOutputsParams` (at most one of them may be given;
each malformed one is a 400 naming it), with the name of the field it came from (the engine
compiles it when the request is added, and `Generation` names that field when it cannot);
`reasoning.after_reasoning` defers it past `</think>`. Must not: compile anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loopserve.entrypoints.openai.errors import bad_request
from loopserve.entrypoints.openai.protocol import ChatCompletionRequest, GenerationFields
from loopserve.entrypoints.tool_calls import forces_calls, tool_call_constraint
from loopserve.structured_outputs import StructuredOutputsParams

# vLLM's older request fields -> the kind of constraint each gives.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True, slots=True)
class RequestConstraint:
    field: str  # the request field that gave it
    params: StructuredOutputsParams


def request_constraint(request: GenerationFields) -> RequestConstraint | None:
    """The request's constraint (None: free text); a 400 OpenAIError when the fields are bad."""
    given: list[tuple[str, Callable[[], StructuredOutputsParams | None]]] = []
    if request.structured_outputs is not None:
        body = request.structured_outputs
        given.append(("structured_outputs", lambda: StructuredOutputsParams.from_dict(body)))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            given.append((name, _guided(kind, value)))
    if isinstance(request, ChatCompletionRequest):
        response_format = request.response_format
        if response_format is not None and response_format.get("type") != "text":
            given.append(("response_format", lambda: _response_format(response_format)))
        if forces_calls(request.tool_choice):
            given.append(("tool_choice", lambda: _tool_choice(request)))
    if len(given) > 1:
        names = ", ".join(name for name, _ in given)
        raise bad_request(f"give at most one constraint on the output, got {names}", given[1][0])
    if not given:
        return None
    name, build = given[0]
    try:
        params = build()
    except (TypeError, ValueError) as error:
        raise bad_request(f"{name}: {error}", name) from None
    return None if params is None else RequestConstraint(name, params)


def _guided(kind: str, value: Any) -> Callable[[], StructuredOutputsParams]:
    if kind == "choice" and isinstance(value, list):
        value = tuple(value)
    return lambda: StructuredOutputsParams(**{kind: value})


def _response_format(response_format: dict[str, Any]) -> StructuredOutputsParams:
    kind = response_format.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("json_schema must be an object with a 'schema' (a JSON schema object)")
    strict = spec.get("strict", False) if isinstance(spec, dict) else False
    if not isinstance(strict, bool):
        raise ValueError(f"json_schema.strict must be a bool, got {strict!r}")
    return StructuredOutputsParams(json=schema)  # enforced, strict or not


def _tool_choice(request: ChatCompletionRequest) -> StructuredOutputsParams | None:
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
    return tool_call_constraint(tools, request.tool_choice, request.parallel_tool_calls)
