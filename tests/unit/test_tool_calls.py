"""Hermes tool-call parsing: calls out of the text, arguments as JSON text, blocks that are no
call kept as text, and the same result however the stream is cut."""

from __future__ import annotations

import itertools
import json

import pytest

from loopserve.entrypoints.tool_calls import (
    ToolCallStreamer,
    parse_tool_calls,
    parses_tool_calls,
)

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [  # (reply, content, [(name, arguments)])
    (WEATHER, "", [("get_weather", {"city": "Paris"})]),
    ("Let me check. " + WEATHER, "Let me check. ", [("get_weather", {"city": "Paris"})]),
    (WEATHER + WEATHER, "", [("get_weather", {"city": "Paris"})] * 2),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("f", {"x": 1})]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('cut <tool_call>{"name": "f"', 'cut <tool_call>{"name": "f"', []),
    ("no calls, a < sign and <tool", "no calls, a < sign and <tool", []),
]


def _plain(calls: list) -> list[tuple[str, object]]:  # type: ignore[type-arg]
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_a_whole_reply(text: str, content: str, calls: list[tuple[str, object]]) -> None:
    got_content, got_calls = parse_tool_calls(text)
    assert (got_content, _plain(got_calls)) == (content, calls)
    assert len({call.id for call in got_calls}) == len(got_calls)  # every call its own id


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_cut_of_a_stream(text: str, content: str, calls: list[tuple[str, object]]) -> None:
    for cut in range(len(text) + 1):
        streamer = ToolCallStreamer()
        pieces = [streamer.feed(piece) for piece in (text[:cut], text[cut:])]
        pieces.append(streamer.finish())
        got_content = "".join(piece[0] for piece in pieces)
        got_calls = list(itertools.chain.from_iterable(piece[1] for piece in pieces))
        assert (got_content, _plain(got_calls)) == (content, calls), cut


def test_which_parser_runs() -> None:
    assert parses_tool_calls("auto", "{{ '<tool_call>' }}")
    assert not parses_tool_calls("auto", "plain") and not parses_tool_calls("auto", None)
    assert parses_tool_calls("hermes", None) and not parses_tool_calls("none", "<tool_call>")
    with pytest.raises(ValueError, match=r"\(--tool-call-parser\) must be one of"):
        parses_tool_calls("mistral", None)
