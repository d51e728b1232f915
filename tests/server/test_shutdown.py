"""Graceful shutdown of `loopserve serve` (a real subprocess) on SIGTERM: a request that can
finish within --shutdown-timeout completes; streams that cannot are aborted when the timeout
passes and end cleanly with `finish_reason: "abort"`, non-streamed ones get 503; the process
exits. The same with the engine in a process of its own (the default) and in a thread of the
server (`--no-engine-process`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .server_testing import (
    CLI,
    engine_processes,
    free_port,
    sigint_as_default,
    start_serve_process,
    write_tiny_model,
)

SHUTDOWN_TIMEOUT_S = 2
LONG_MAX_TOKENS = 4000  # thousands of engine steps: cannot finish within the timeout


def _start_server(model: Path, port: int, *flags: str) -> subprocess.Popen[bytes]:
    shutdown = ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--num-kv-pages", "4096"]
    return start_serve_process(model, port, *shutdown, *flags)


# The engine in the server's thread, and in a process of its own (the default).
ENGINE_PLACES = pytest.mark.parametrize(
    "flags", [["--no-engine-process"], []], ids=["engine-thread", "engine-process"]
)


def _wait_for_running(port: int, count: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        if f"loopserve:num_requests_running {count}" in metrics.splitlines():
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} requests never ran together")


class _Stream(threading.Thread):
    """Reads one streamed completion; records its events and how it ended."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.body = {
            "prompt": "x y z",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        self.first_event = threading.Event()
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.done = False
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=60) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        choice = json.loads(line.removeprefix("data: "))["choices"][0]
                        self.num_tokens += len(choice["exit_depths"])
                        self.finish_reason = choice["finish_reason"]
                        self.first_event.set()
        except httpx.HTTPError as error:
            self.error = error


class _Unstreamed(threading.Thread):
    """Waits for one non-streamed completion; records its status and error."""

    def __init__(self, port: int, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.body = {"prompt": "y", "max_tokens": max_tokens, "ignore_eos": True}
        self.status = 0
        self.error: dict[str, str] = {}

    def run(self) -> None:
        response = httpx.post(self.url, json=self.body, timeout=60)
        self.status = response.status_code
        self.error = response.json().get("error", {})


@pytest.mark.slow
@ENGINE_PLACES
def test_sigterm_drains_then_aborts(tmp_path: Path, flags: list[str]) -> None:
    model = write_tiny_model(tmp_path / "model", max_model_len=LONG_MAX_TOKENS + 64)
    port = free_port()
    process = _start_server(model, port, *flags)
    try:
        long, short = _Stream(port, LONG_MAX_TOKENS), _Stream(port, 24)
        long.start()
        assert long.first_event.wait(30)
        waiting = _Unstreamed(port, LONG_MAX_TOKENS)
        waiting.start()
        short.start()
        assert short.first_event.wait(30)
        _wait_for_running(port, 3)
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        short.join(30)
        assert (short.done, short.finish_reason, short.num_tokens) == (True, "length", 24)
        _, stderr = process.communicate(timeout=SHUTDOWN_TIMEOUT_S + 30)
        long.join(10)
        waiting.join(10)
    finally:
        if process.poll() is None:
            process.kill()
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 20
    assert process.returncode in (0, -signal.SIGTERM), stderr.decode()[-2000:]
    assert long.error is None
    assert (long.done, long.finish_reason) == (True, "abort")
    assert 0 < long.num_tokens < LONG_MAX_TOKENS
    assert waiting.status == 503 and waiting.error["type"] == "server_error"
    assert b"Traceback" not in stderr, stderr.decode()[-2000:]


@ENGINE_PLACES
def test_ctrl_c_on_an_idle_server_is_one_line_and_exit_code_130(
    tmp_path: Path, flags: list[str]
) -> None:
    process = start_serve_process(write_tiny_model(tmp_path / "model"), free_port(), *flags)
    try:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    text = stderr.decode()
    assert process.returncode == 130, text[-2000:]
    assert "Traceback" not in text and "CancelledError" not in text, text[-2000:]
    assert text.strip().splitlines() == ["loopserve serve: interrupted"]


def test_ctrl_c_while_the_engine_process_starts_ends_it_at_once() -> None:
    """Ctrl-C in a terminal reaches the whole process group, the engine process too: the server
    stops waiting for the model and ends the engine process it started (which ignores the
    signal from its start: no traceback from it), one line and exit code 130 as ever."""
    command = [
        sys.executable, "-c", CLI, "serve", "--model", "ouro-tiny", "--port", str(free_port()),
        "--device", "cpu", "--num-kv-pages", "64", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=sigint_as_default,
        start_new_session=True,  # a process group of its own, as a terminal's job
    )
    try:
        deadline = time.monotonic() + 30
        while not (children := engine_processes(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, "no engine process"
            time.sleep(0.01)
        time.sleep(0.2)  # within the child's start-up (importing torch alone takes longer)
        os.killpg(process.pid, signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    text = stderr.decode()
    assert process.returncode == 130, text[-2000:]
    assert text.strip().splitlines() == ["loopserve serve: interrupted"], text[-2000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in children)
