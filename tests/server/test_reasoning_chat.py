"""Chat replies with a reasoning parser: on a checkpoint whose template writes `<think>` (the
scripted Ouro-like one: it answers "Hello"), a reply to a prompt that leaves `<think>` open is
reasoning, streamed and not; with thinking off, or with `--reasoning-parser none`, it is content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.real_ouro import ANSWER, write_ouro_like_checkpoint

from .server_testing import RunningServer, serve_in_thread

THINKING = {"enable_thinking": True}


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ouro_like_checkpoint(tmp_path_factory.mktemp("ouro-thinking"))


@pytest.fixture(scope="module")
def server(ouro_dir: Path) -> Iterator[RunningServer]:
    with serve_in_thread(ouro_dir) as running:
        yield running


def _chat(server: RunningServer, stream: bool, **fields: Any) -> dict[str, Any] | list[dict]:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": stream, "max_tokens": 8}
    body |= fields
    url = f"{server.url}/v1/chat/completions"
    if not stream:
        reply = httpx.post(url, json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return dict(reply.json()["choices"][0]["message"])
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    return [json.loads(line)["choices"][0]["delta"] for line in lines if line != "[DONE]"]


def test_a_reply_inside_an_open_think_is_reasoning(server: RunningServer) -> None:
    message = _chat(server, False, chat_template_kwargs=THINKING)
    assert (message["reasoning_content"], message["content"]) == (ANSWER, "")
    deltas = _chat(server, True, chat_template_kwargs=THINKING)
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == ANSWER
    assert all(not d.get("content") for d in deltas)


def test_with_thinking_off_the_reply_is_content(server: RunningServer) -> None:
    message = _chat(server, False)
    assert (message["reasoning_content"], message["content"]) == (None, ANSWER)
    deltas = _chat(server, True)
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    assert all(d.get("reasoning_content") is None for d in deltas)


def test_parser_none_keeps_the_whole_reply_as_content(ouro_dir: Path) -> None:
    with serve_in_thread(ouro_dir, reasoning_parser="none") as plain:
        message = _chat(plain, False, chat_template_kwargs=THINKING)
    assert (message["reasoning_content"], message["content"]) == (None, ANSWER)


def test_the_openai_client_reads_the_reasoning(server: RunningServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        extra_body={"chat_template_kwargs": THINKING},
    )
    message = reply.choices[0].message
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == ANSWER
