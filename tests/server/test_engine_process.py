"""The engine in a process of its own, `loopserve serve`'s default (`--no-engine-process`: in a
thread): the engine in a child process answers exactly as the engine thread does (completions and
chat, streamed and whole, `n` > 1, logprobs, stop strings, token ids); a client that leaves
mid-stream frees its request's KV pages; a refused setting or a missing checkpoint is the same
one-line error; an app that cannot start ends its engine process; an engine process that dies
makes the server answer 503 (and /health fail), not hang."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loopserve.config import EngineConfig
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.models.builtin import BUILTIN_MODEL_DIR

from .server_testing import RunningServer, serve_in_thread

pytestmark = pytest.mark.slow

BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "def add(a, b):\n", "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"prompt": ["import os\n", "class A:\n"], "max_tokens": 9, "n": 2,
                         "temperature": 0.8, "seed": 5, "stream": True}),
    ("/v1/completions", {"prompt": "x = [", "max_tokens": 20, "stop": [",", "]"], "logprobs": 2,
                         "temperature": 0, "return_token_ids": True, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}],
                              "max_tokens": 10, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count."}],
                              "max_tokens": 10, "temperature": 0, "stream": True, "n": 2}),
]  # fmt: skip


def _answer(server: RunningServer, path: str, body: dict[str, Any]) -> Any:
    """The choices of a reply (streamed: the events' choices in order), without ids and times."""
    url = server.url + path
    if not body.get("stream"):
        reply = httpx.post(url, json=body | {"model": "tiny"}, headers=server.headers, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"]
    events = []
    with httpx.stream("POST", url, json=body | {"model": "tiny"}, headers=server.headers,
                      timeout=60) as reply:  # fmt: skip
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: "))["choices"])
    return events


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RunningServer, RunningServer]]:
    with (
        serve_in_thread(BUILTIN_MODEL_DIR, engine_process=True) as in_process,
        serve_in_thread(BUILTIN_MODEL_DIR) as threaded,
    ):
        yield in_process, threaded


def test_answers_equal_the_engine_threads(servers: tuple[RunningServer, RunningServer]) -> None:
    separate, threaded = servers
    for path, body in BODIES:
        assert _answer(separate, path, body) == _answer(threaded, path, body), (path, body)


def test_a_client_that_leaves_frees_its_pages(servers: tuple[RunningServer, RunningServer]) -> None:
    separate, _ = servers
    body = {"model": "tiny", "prompt": "def f():\n", "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    url = separate.url + "/v1/completions"
    with httpx.stream("POST", url, json=body, headers=separate.headers, timeout=60) as reply:
        lines = reply.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert separate.metrics()["loopserve:num_requests_running"] == 1
    deadline = time.monotonic() + 20
    while separate.metrics()["loopserve:kv_pages_used"] > 0:
        assert time.monotonic() < deadline, "the aborted request kept its pages"
        time.sleep(0.1)
    assert separate.metrics()["loopserve:num_requests_running"] == 0


@pytest.mark.parametrize(
    ("flags", "separate"),
    [([], True), (["--engine-process"], True), (["--no-engine-process"], False)],
    ids=["default", "engine-process", "no-engine-process"],
)
def test_serve_runs_the_engine_in_a_process_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], separate: bool
) -> None:
    from loopserve.entrypoints.cli import main
    from loopserve.entrypoints.openai import server

    configs: list[ServerConfig] = []

    def run_server(engine: EngineConfig, config: ServerConfig, sock: Any, *args: Any) -> None:
        sock.close()
        configs.append(config)

    monkeypatch.setattr(server, "run_server", run_server)
    assert main(["serve", "--port", "0", "--device", "cpu", *flags]) == 0
    assert [config.engine_process for config in configs] == [separate]
    assert ServerConfig().engine_process


@pytest.mark.parametrize(
    "options",
    [{"max_model_len": 10**6}, {"model": "/nonexistent/checkpoint"}],
    ids=["setting", "missing-checkpoint"],
)
def test_a_refusal_is_the_in_process_error(options: dict[str, Any]) -> None:
    """The same class (ValueError, FileNotFoundError: `loopserve` reports both in one line) and
    the same message."""
    from loopserve import LLM
    from loopserve.entrypoints.openai.engine_process import EngineChild

    options = {"model": str(BUILTIN_MODEL_DIR)} | options
    with pytest.raises((ValueError, FileNotFoundError)) as in_process:
        LLM(**options)
    with pytest.raises(in_process.type) as separate:
        EngineChild.spawn(EngineConfig.from_options(**options))
    assert str(separate.value) == str(in_process.value)


def test_an_app_that_cannot_start_ends_its_engine_process() -> None:
    """A chat template that does not compile fails after the engine process started: the error
    comes back and the process ends (it kept `loopserve serve` from exiting)."""
    from loopserve.entrypoints.openai.server import bind_socket, run_server

    before = set(multiprocessing.active_children())
    engine = EngineConfig.from_options(model=str(BUILTIN_MODEL_DIR), num_kv_pages=64)
    sock = bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(ValueError, match="chat template does not compile"):
            config = ServerConfig(chat_template="{% for x in %}", engine_process=True)
            run_server(engine, config, sock)
    finally:
        sock.close()
    assert set(multiprocessing.active_children()) == before


def test_a_dead_engine_process_gets_503_not_a_hang() -> None:
    before = set(multiprocessing.active_children())
    with serve_in_thread(BUILTIN_MODEL_DIR, engine_process=True) as server:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        (child,) = set(multiprocessing.active_children()) - before
        assert child.name == "loopserve-engine"
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while httpx.get(server.url + "/health", timeout=10).status_code == 200:
            assert time.monotonic() < deadline, "/health still 200 after the engine died"
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        reply = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                           timeout=30)  # fmt: skip
        assert reply.status_code == 503
        assert "exited unexpectedly" in reply.text or "not running" in reply.text


def test_a_request_the_engine_refuses_is_400_with_its_message() -> None:
    """Refused by the engine itself (more KV pages than the cache has), not by the HTTP checks:
    the child's ValueError comes back as the in-process server's 400."""
    body = {"model": "tiny", "prompt": "def f():\n", "max_tokens": 600, "ignore_eos": True}
    replies = []
    for separate in (False, True):
        with serve_in_thread(
            BUILTIN_MODEL_DIR, engine={"num_kv_pages": 24}, engine_process=separate
        ) as server:
            reply = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                               timeout=30)  # fmt: skip
            message = re.sub(r"'cmpl-[\w-]+'", "ID", reply.json()["error"]["message"])
            replies.append((reply.status_code, message))
            ok = httpx.post(server.url + "/v1/completions", json=body | {"max_tokens": 4},
                            headers=server.headers, timeout=30)  # fmt: skip
            assert ok.status_code == 200  # the engine serves on
    assert replies[0] == replies[1]
    assert replies[0][0] == 400 and "KV pages" in replies[0][1], replies


def test_a_message_the_server_cannot_take_stops_it_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader fails on a message (here: rebuilding outputs raises): requests get an error,
    not a hang, /health fails, and the engine process ends (its pipe is closed)."""
    from loopserve.entrypoints.openai import output_deltas

    def broken(self: object, deltas: list[Any]) -> list[Any]:
        raise RuntimeError("cannot rebuild these outputs")

    monkeypatch.setattr(output_deltas.DeltaDecoder, "decode", broken)
    before = set(multiprocessing.active_children())
    with serve_in_thread(BUILTIN_MODEL_DIR, engine_process=True) as server:
        (child,) = set(multiprocessing.active_children()) - before
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        reply = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                           timeout=30)  # fmt: skip
        assert reply.status_code in (500, 503) and "cannot rebuild" in reply.text, reply.text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        child.join(20)
        assert not child.is_alive()
