"""Tool calls in a reply: Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
blocks parsed out of the text, whole or as it streams.

Owns: which parser a server runs (`auto`: `hermes` when the chat template writes `<tool_call>`,
else `none`), `parse_tool_calls` (a whole reply -> its content and calls) and `ToolCallStreamer`
(pieces -> content pieces and each call once its block is complete; text that may start a block
is held back until it cannot, so a stream cut anywhere gives what the whole reply gives), and
`tool_call_constraint`, the grammar that makes a reply nothing but calls (`tool_choice`
"required": one or more calls of the offered tools; a named function: one call of it) whose
arguments match each function's JSON schema. A block whose body is not a JSON object with a
string `name` stays text. Must not: import torch or know about requests (the chat writer feeds
it the reply's content).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from loopserve.entrypoints.reasoning import parser_runs, partial_tag
from loopserve.outputs import ToolCall
from loopserve.structured.grammar import JSON_OPTIONS
from loopserve.structured_outputs import StructuredOutputsParams

START, END = "<tool_call>", "</tool_call>"
# `--tool-call-parser` values.
PARSERS = ("auto", "hermes", "none")
# `tool_choice` strings (the default with tools is "auto"); a named function is
# {"type": "function", "function": {"name": ...}}.
TOOL_CHOICES = ("auto", "none", "required")


def parses_tool_calls(parser: str, chat_template: str | None) -> bool:
    """Whether replies are parsed for tool calls, for a parser name and the template's source."""
    return parser_runs("tool_call_parser", parser, PARSERS, START, chat_template)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside complete tool-call blocks, the calls in order) of a whole reply."""
    streamer = ToolCallStreamer()
    content, calls = streamer.feed(text)
    tail, more = streamer.finish()
    return content + tail, calls + more


class ToolCallStreamer:
    """Splits one reply's content, fed in pieces, into content pieces and tool calls."""

    def __init__(self) -> None:
        self._held = ""  # text that may be (the start of) a tool-call block

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the complete calls that `text` (the next piece) releases."""
        pending, self._held = self._held + text, ""
        content, calls = "", []
        while pending:
            start = pending.find(START)
            if start == -1:
                keep = partial_tag(pending, START)
                content += pending[: len(pending) - keep]
                self._held = pending[len(pending) - keep :]
                break
            content += pending[:start]
            end = pending.find(END, start + len(START))
            if end == -1:
                self._held = pending[start:]
                break
            block = pending[start : end + len(END)]
            call = _call(block[len(START) : -len(END)])
            if call is None:
                content += block  # not a call: it stays text
            else:
                calls.append(call)
            pending = pending[end + len(END) :]
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What was held back at the end of the reply: a block never closed is text."""
        held, self._held = self._held, ""
        return held, []


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text)


def forces_calls(tool_choice: str | Mapping[str, Any] | None) -> bool:
    """Whether `tool_choice` makes the reply tool calls ("required" or a named function; an
    unknown choice too, so that `tool_call_constraint` refuses it)."""
    return tool_choice not in (None, "auto", "none")


def tool_call_constraint(
    tools: Sequence[Mapping[str, Any]],
    tool_choice: str | Mapping[str, Any] | None,
    parallel: bool = True,
) -> StructuredOutputsParams | None:
    """The constraint `tool_choice` puts on a reply: "required", one call or more (exactly one
    unless `parallel`), a named function, one call of it; None for "auto", "none" and unset.
    ValueError when the choice is unknown, names no offered tool, or there are no tools."""
    if not forces_calls(tool_choice):
        return None
    functions = {tool["function"]["name"]: tool["function"] for tool in tools}
    if not functions:
        raise ValueError("tool_choice 'required' or a named function needs tools")
    if tool_choice == "required":
        names, calls = list(functions), "call+" if parallel else "call"
    else:
        name = _named_choice(tool_choice)
        if name not in functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        names, calls = [name], "call"
    bodies = [_call_schema(name, functions[name].get("parameters")) for name in names]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    schema = {**body, "x-guidance": JSON_OPTIONS}
    grammar = (
        f'start: {calls}\ncall: "{START}\\n" body "\\n{END}"\nbody: %json {json.dumps(schema)}'
    )
    return StructuredOutputsParams(grammar=grammar)


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or not name:
        raise ValueError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
            f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"
        )
    return str(name)


def _call_schema(name: str, parameters: Any) -> dict[str, Any]:
    """The JSON schema of one call's body: the function's name and arguments."""
    arguments = parameters if isinstance(parameters, dict) else {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
