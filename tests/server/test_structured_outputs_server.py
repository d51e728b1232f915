"""Structured outputs through `loopserve serve`, read by the official `openai` client. On the
built-in model (it knows no JSON: only the constraint can make its output valid): random JSON
schemas, a regex, a choice and a grammar on completions and chat, streamed and not, greedy and
sampled; `response_format` json_schema and json_object; `tool_choice` required and named give
calls that always parse and match their function's schema, streamed and not. On a checkpoint
whose template writes `<think>`: the constraint starts after `</think>`."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from loopserve.models.builtin import BUILTIN_MODEL_DIR
from tests.constraint_cases import CHOICE, GRAMMAR, GRAMMAR_TEXT, REGEX, SCHEMA, random_schema
from tests.real_ouro import ANSWER, write_ouro_like_checkpoint

from .server_testing import CHAT_TEMPLATE, RunningServer, serve_in_thread

jsonschema = pytest.importorskip("jsonschema")

HI = [{"role": "user", "content": "Hi"}]
# Functions whose arguments a model always finishes writing (bounded strings, an enum).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,  # else a model may add keys forever
        },
    },
}
ALARM = {
    "type": "function",
    "function": {
        "name": "set_alarm",
        "parameters": {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                "repeat": {"enum": ["daily", "once"]},
            },
            "required": ["hour", "repeat"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, ALARM)}


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_in_thread(
        BUILTIN_MODEL_DIR, {"dtype": "float32"}, chat_template=CHAT_TEMPLATE,
        tool_call_parser="hermes",
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def _complete(client: Any, stream: bool, **request: Any) -> tuple[str, str | None]:
    """(text, finish_reason) of one completion, streamed or not."""
    request = {"model": "tiny", "max_tokens": 160, **request}
    if not stream:
        choice = client.completions.create(**request).choices[0]
        return choice.text, choice.finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **request):
        for choice in chunk.choices:
            text += choice.text
            finish = choice.finish_reason or finish
    return text, finish


def _chat(client: Any, stream: bool, **request: Any) -> dict[str, Any]:
    """The reply's content, reasoning, tool calls and finish reason, streamed or not."""
    request = {"model": "tiny", "messages": HI, "max_tokens": 160, **request}
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return {"content": choice.message.content, "calls": calls, "finish": choice.finish_reason}
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or ():
                name, arguments = calls.setdefault(call.index, ["", ""])
                calls[call.index] = [
                    name + (call.function.name or ""),
                    arguments + (call.function.arguments or ""),
                ]
            finish = choice.finish_reason or finish
    return {"content": content, "calls": [tuple(c) for c in calls.values()], "finish": finish}


def test_random_schemas_give_valid_json_streamed_and_not(client: Any) -> None:
    rng = random.Random(7)
    schemas = [random_schema(rng, depth=1 if index % 3 else 0) for index in range(16)]

    def one(index: int) -> tuple[str, str | None]:
        return _complete(
            client, index % 2 == 0, prompt="{", temperature=0.0 if index % 4 < 2 else 0.8,
            seed=index, extra_body={"structured_outputs": {"json": schemas[index]}},
        )  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(len(schemas))))
    for schema, (text, finish) in zip(schemas, results, strict=True):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_regex_choice_and_grammar_on_completions_and_chat(client: Any, stream: bool) -> None:
    text, _ = _complete(client, stream, prompt="import os\n", extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, text)
    text, finish = _complete(
        client, stream, prompt="# sum", extra_body={"structured_outputs": {"grammar": GRAMMAR}}
    )
    assert finish == "stop" and GRAMMAR_TEXT.fullmatch(text), text
    reply = _chat(client, stream, extra_body={"structured_outputs": {"choice": list(CHOICE)}})
    assert reply["content"] in CHOICE and reply["finish"] == "stop"
    reply = _chat(client, stream, temperature=0.9, seed=3, extra_body={"guided_choice": ["x", "y"]})
    assert reply["content"] in ("x", "y")


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_and_json_object(client: Any, stream: bool) -> None:
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "pair", "schema": SCHEMA, "strict": True},
    }
    reply = _chat(client, stream, response_format=schema_format)
    assert reply["finish"] == "stop", reply
    jsonschema.validate(json.loads(reply["content"]), SCHEMA)
    reply = _chat(client, stream, response_format={"type": "json_object"}, max_tokens=400)
    assert isinstance(json.loads(reply["content"]), dict), reply


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}]
)
def test_forced_tool_choices_always_give_calls_that_parse(
    client: Any, stream: bool, tool_choice: Any
) -> None:
    for seed in range(3):
        reply = _chat(
            client, stream, tools=[WEATHER, ALARM], tool_choice=tool_choice, temperature=0.8,
            seed=seed, max_tokens=300, parallel_tool_calls=False,
        )  # fmt: skip
        assert reply["finish"] == "tool_calls" and len(reply["calls"]) == 1, reply
        ((name, arguments),) = reply["calls"]
        assert name == "set_alarm" or tool_choice == "required"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert not reply["content"]


def test_required_with_parallel_calls_gives_calls_one_after_another(client: Any) -> None:
    """This model never stops calling: every call it completes within max_tokens parses."""
    reply = _chat(client, False, tools=[WEATHER, ALARM], tool_choice="required", max_tokens=120)
    assert len(reply["calls"]) > 1, reply
    for name, arguments in reply["calls"]:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(server: RunningServer) -> None:
    body = {
        "model": "tiny",
        "messages": HI,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}},
    }
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "response_format", error
    assert "does not compile" in error["message"] or "json" in error["message"], error


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    checkpoint = write_ouro_like_checkpoint(
        tmp_path_factory.mktemp("ouro-closes-thinking"), closes_thinking=True
    )
    with serve_in_thread(checkpoint) as running:
        yield running


def _thinking_chat(server: RunningServer, stream: bool, thinking: bool) -> tuple[Any, str, str]:
    """(finish_reason, reasoning, content) of a reply constrained to "yes" / "no"."""
    body = {
        "messages": HI, "max_tokens": 40, "stream": stream,
        "chat_template_kwargs": {"enable_thinking": thinking},
        "structured_outputs": {"choice": ["yes", "no"]},
    }  # fmt: skip
    url = f"{server.url}/v1/chat/completions"
    if not stream:
        reply = httpx.post(url, json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        message = choice["message"]
        return choice["finish_reason"], message["reasoning_content"] or "", message["content"]
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    choices = [json.loads(line)["choices"][0] for line in lines if line != "[DONE]"]
    deltas = [choice["delta"] for choice in choices]
    return (
        choices[-1]["finish_reason"],
        "".join(delta.get("reasoning_content") or "" for delta in deltas),
        "".join(delta.get("content") or "" for delta in deltas),
    )


@pytest.mark.parametrize("stream", [False, True])
def test_with_reasoning_the_constraint_starts_after_the_end_tag(
    thinking_server: RunningServer, stream: bool
) -> None:
    """Unconstrained, this model writes "Hello</think>Hello</think>..." to the end."""
    finish, reasoning, content = _thinking_chat(thinking_server, stream, thinking=True)
    assert (finish, reasoning, content in ("yes", "no")) == ("stop", ANSWER, True), content
    finish, reasoning, content = _thinking_chat(thinking_server, stream, thinking=False)
    assert (finish, reasoning, content in ("yes", "no")) == ("stop", "", True), content


def test_the_thinking_checkpoint_really_closes_its_reasoning(tmp_path: Path) -> None:
    """The scripted model above writes `</think>` by itself: the case is not vacuous."""
    from loopserve import LLM, SamplingParams

    checkpoint = write_ouro_like_checkpoint(tmp_path, closes_thinking=True)
    llm = LLM(str(checkpoint), num_kv_pages=64)
    (output,) = llm.generate("Hi", SamplingParams(max_tokens=4, temperature=0.0))
    assert output.outputs[0].text == f"{ANSWER}</think>{ANSWER}</think>"
