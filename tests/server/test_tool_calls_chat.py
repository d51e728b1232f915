"""Chat requests with tools: the tools and tool messages reach the chat template, a reply with no
call is plain content, a server without a parser answers 400. (The scripted model writes no call
by itself; tests/unit/test_tool_calls.py holds the parser, and test_structured_outputs_server.py
the calls that `tool_choice` required / named force.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.real_ouro import ANSWER, CHATML_TEMPLATE, write_ouro_like_checkpoint

from .server_testing import RunningServer, serve_in_thread

# The ChatML template, preceded by the tools' names and followed by tool messages' call ids.
TOOLS_TEMPLATE = (
    "{% if tools %}tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n{% endif %}"
    "{% for message in messages %}{% if message.tool_call_id %}[{{ message.tool_call_id }}]"
    "{% endif %}{% endfor %}" + CHATML_TEMPLATE
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ouro_like_checkpoint(tmp_path_factory.mktemp("ouro-tools"))


@pytest.fixture(scope="module")
def server(ouro_dir: Path) -> Iterator[RunningServer]:
    with serve_in_thread(
        ouro_dir, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes"
    ) as running:
        yield running


def _post(server: RunningServer, **fields: Any) -> httpx.Response:
    body = {"messages": HI, "max_tokens": 8} | fields
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_tools_reach_the_template_and_a_reply_without_a_call_is_content(
    server: RunningServer,
) -> None:
    plain = _post(server).json()
    offered = _post(server, tools=[WEATHER]).json()
    declined = _post(server, tools=[WEATHER], tool_choice="none").json()
    assert offered["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert declined["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    choice = offered["choices"][0]
    assert (choice["message"]["content"], choice["message"]["tool_calls"]) == (ANSWER, None)
    assert choice["finish_reason"] == "stop"


def test_tool_messages_reach_the_template(server: RunningServer) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
            "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turns = [
        *HI,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = _post(server, messages=turns, tools=[WEATHER])
    assert reply.status_code == 200, reply.text
    without_id = _post(server, messages=[*turns[:2], {"role": "tool", "content": "sunny"}])
    assert reply.json()["usage"]["prompt_tokens"] > without_id.json()["usage"]["prompt_tokens"]


def test_a_stream_with_tools_carries_the_content(server: RunningServer) -> None:
    body = {"messages": HI, "max_tokens": 8, "stream": True, "tools": [WEATHER]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        text = "".join(line for line in r.iter_lines())
    assert ANSWER in text and '"tool_calls":[' not in text


def test_a_server_that_parses_no_calls_refuses_tools(ouro_dir: Path) -> None:
    with serve_in_thread(ouro_dir, tool_call_parser="none") as plain:
        reply = _post(plain, tools=[WEATHER])
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
