"""Chat messages through real HTTP: an unknown role or a message without content is a 400 naming
the field (OpenAI's error shape), while an assistant turn with tool_calls may leave content out and
content may be text parts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from .server_testing import RunningServer

CHAT = "/v1/chat/completions"


def _post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    content = json.dumps(body).encode()
    return httpx.post(server.url + CHAT, content=content, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        ([{"role": "wizard", "content": "x"}], "messages.0.role", "'developer'"),
        ([{"role": "user"}], "messages.0.content", "content is required"),
        ([{"role": "user", "content": None}], "messages.0.content", "content is required"),
        (
            [{"role": "user", "content": "x"}, {"role": "tool"}],
            "messages.1.content",
            "content is required",
        ),
        ([{"role": "assistant", "tool_calls": []}], "messages.0.content", "content is required"),
    ],
)
def test_bad_messages_are_400_naming_the_field(
    server: RunningServer, messages: list[dict[str, Any]], param: str, words: str
) -> None:
    response = _post(server, {"messages": messages, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": role, "content": "x"} for role in ("developer", "system", "user")],
        [
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "content": "sunny"},
        ],
    ],
)
def test_good_messages_are_answered(server: RunningServer, messages: list[dict[str, Any]]) -> None:
    response = _post(server, {"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
