"""The error matrix through real HTTP: each bad request gets its status and the OpenAI error
shape `{"error": {"message", "type", "param", "code"}}`, and the server stays healthy."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from .server_testing import MAX_REQUEST_BYTES, RunningServer, serve_in_thread

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _post(server: RunningServer, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    headers = {**server.headers, **kwargs.pop("headers", {})}
    if isinstance(body, (dict, list)):  # ASCII JSON: it can carry lone surrogates ("\ud800")
        headers["Content-Type"] = "application/json"
        body = json.dumps(body).encode()
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30, **kwargs)


def _assert_error(
    response: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture(autouse=True)
def server_stays_healthy(server: RunningServer) -> Iterator[None]:
    yield
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    response = _post(server, COMPLETIONS, {"model": "tiny", "prompt": "ok", "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "tiny", "prompt": "unterminated', None),
        (b"", None),
        (b"[1, 2, 3]", None),
        (b"\xff\xfe not utf-8", None),
        ({"model": "tiny"}, "prompt"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": [1, "two"]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, None),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, None),
        ({"prompt": "x", "top_p": 0.0}, "top_p"),
        ({"prompt": "x", "exit_threshold": 0.0}, "exit_threshold"),
        ({"prompt": "x", "min_loops": 0}, "min_loops"),
        ({"prompt": "x", "min_loops": 9}, "min_loops"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "max_loops": 9}, "max_loops"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
        ({"prompt": [1, 2, 2**40], "echo": True}, "prompt"),
        ({"prompt": "\ud800"}, "prompt"),
        ({"prompt": "x", "model": "\ud800"}, "model"),
        ({"prompt": "x", "stop": ["s"] * 100}, "stop"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "n": 200}, "n"),
    ],
)
def test_bad_completion_requests_are_400(server: RunningServer, body: Any, param: str) -> None:
    _assert_error(_post(server, COMPLETIONS, body), 400, param=param)
    if isinstance(body, dict) and "stream_options" not in body:
        # The same body, streamed, is refused before any event.
        _assert_error(_post(server, COMPLETIONS, {**body, "stream": True}), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools.0.function",
        ),
        ({"messages": [{"role": "user", "content": "\udfff"}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30, "logprobs": True},
            "top_logprobs",
        ),
    ],
)
def test_bad_chat_requests_are_400(server: RunningServer, body: Any, param: str) -> None:
    _assert_error(_post(server, CHAT, body), 400, param=param)


def test_unknown_model_is_404(server: RunningServer) -> None:
    response = _post(server, COMPLETIONS, {"model": "gpt-9", "prompt": "x"})
    error = _assert_error(response, 404, param="model", code="model_not_found")
    assert "gpt-9" in error["message"]
    chat = {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
    _assert_error(_post(server, CHAT, chat), 404, param="model")


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"prompt": "x", "seed": ' + b"1" * 5000 + b"}", "--max-json-number-digits"),
        (b'{"prompt": "x", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "--max-json-depth"),
        (b'{"prompt": "x", "temperature": Infinity}', "finite"),
        (b'{"prompt": "x", "top_p": NaN}', "finite"),
    ],
)
def test_bodies_past_the_json_limits_are_400(server: RunningServer, raw: bytes, words: str) -> None:
    error = _assert_error(_post(server, COMPLETIONS, raw), 400)
    assert words in error["message"]


def test_context_overflow_is_400(server: RunningServer) -> None:
    body = {"prompt": list(range(1, 201)), "max_tokens": 100}
    error = _assert_error(_post(server, COMPLETIONS, body), 400, param="max_tokens")
    assert "256" in error["message"] and "300" in error["message"]
    full = {"prompt": list(range(1, 257))}  # no room left at all
    _assert_error(_post(server, COMPLETIONS, full), 400, param="prompt")
    long_chat = {"messages": [{"role": "user", "content": "word " * 300}]}
    _assert_error(_post(server, CHAT, long_chat), 400, param="messages")


def test_oversized_body_is_413(server: RunningServer) -> None:
    body = json.dumps({"prompt": "x" * MAX_REQUEST_BYTES}).encode()
    _assert_error(_post(server, COMPLETIONS, body), 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:  # chunked transfer: no Content-Length to check up front
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'

    _assert_error(_post(server, COMPLETIONS, chunks()), 413, code="request_too_large")


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": ""}])
@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", COMPLETIONS), ("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics")],
)
def test_missing_or_wrong_api_key_is_401(
    server: RunningServer, headers: dict[str, str], method: str, path: str
) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    response = httpx.request(method, server.url + path, json=body, headers=headers, timeout=10)
    _assert_error(response, 401, code="invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"


def test_health_needs_no_key_and_unknown_paths_are_404(server: RunningServer) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    response = httpx.get(f"{server.url}/v1/nothing", headers=server.headers, timeout=10)
    _assert_error(response, 404)
    response = httpx.get(server.url + COMPLETIONS, headers=server.headers, timeout=10)
    _assert_error(response, 405)


def test_openai_client_raises_typed_errors(client: Any) -> None:
    import openai

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=1000)
    wrong_key = client.with_options(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        wrong_key.completions.create(model="tiny", prompt="x", max_tokens=2)


# ----- a second server: no chat template, one request at a time --------------------------------


@pytest.fixture(scope="module")
def strict_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    directory = tmp_path_factory.mktemp("no-chat-template")
    for path in tiny_model.iterdir():
        shutil.copy(path, directory / path.name)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    with serve_in_thread(directory, max_concurrent_requests=1) as running:
        yield running


def test_chat_without_template_is_400(strict_server: RunningServer) -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    error = _assert_error(_post(strict_server, CHAT, body), 400, param="messages")
    assert "chat template" in error["message"]


def test_too_many_concurrent_requests_is_429(strict_server: RunningServer) -> None:
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "stream": True}
    url = strict_server.url + COMPLETIONS
    with httpx.Client(timeout=30) as http, http.stream("POST", url, json=body) as stream:
        lines = stream.iter_lines()  # kept open: closing it would disconnect the client
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["choices"]
        response = _post(strict_server, COMPLETIONS, {"prompt": "x", "max_tokens": 2})
        _assert_error(response, 429, code="too_many_requests")
        assert int(response.headers["retry-after"]) >= 1
        # Only generation counts: models and metrics still answer.
        assert httpx.get(strict_server.url + "/v1/models", timeout=10).status_code == 200
        assert next(line for line in lines if line).startswith("data: {")  # still streaming
    samples = strict_server.wait_until_idle()
    assert samples["loopserve:kv_pages_used"] == 0
    response = _post(strict_server, COMPLETIONS, {"prompt": "x", "max_tokens": 2})
    assert response.status_code == 200, response.text
