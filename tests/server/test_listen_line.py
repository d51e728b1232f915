"""`loopserve serve` says where it listens: one line on stdout, with the port really bound (so
`--port 0` can be found), once the server accepts connections."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .server_testing import CLI, engine_processes


@pytest.mark.parametrize("separate", [False, True], ids=["engine-thread", "engine-process"])
def test_serve_prints_the_address_it_listens_on(separate: bool) -> None:
    """With the engine in a process of its own (the default: one spawned child, which SIGTERM
    ends with the server) and in a thread (`--no-engine-process`: no child); either way the
    engine's log records reach stderr as --log-level asks."""
    command = [
        sys.executable, "-c", CLI, "--log-level", "info", "serve", "--model", "ouro-tiny",
        "--port", "0", "--device", "cpu", "--num-kv-pages", "64", "--uvicorn-log-level", "warning",
        *([] if separate else ["--no-engine-process"]),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        stdout = process.stdout
        assert stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
        line = lines.get(timeout=30)
        match = re.fullmatch(r"loopserve serve: listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert match is not None, repr(line)
        assert int(match[2]) != 0
        # Printed once the model has loaded: the address answers at once.
        assert httpx.get(match[1] + "/health", timeout=10).status_code == 200
        children = engine_processes(process.pid)
        assert len(children) == int(separate)
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{pid}") for pid in children):
        assert time.monotonic() < deadline, "the engine process outlived the server"
        time.sleep(0.1)
    assert process.stderr is not None
    assert "INFO loopserve.models.loader: loaded " in process.stderr.read()


@pytest.mark.slow
def test_serve_with_replicas_prints_the_port_it_bound() -> None:
    """`--replicas` with `--port 0`: Ray Serve's proxy binds the port itself, so the engine picks
    a free one first and the line names it (it once printed port 0)."""
    pytest.importorskip("ray.serve", reason="needs the `ray` extra")
    command = [
        sys.executable, "-c", CLI, "serve", "--model", "ouro-tiny", "--port", "0",
        "--device", "cpu", "--num-kv-pages", "64", "--replicas", "1",
    ]  # fmt: skip
    env = os.environ | {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        stdout = process.stdout
        assert stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
        pattern = (
            r"loopserve serve: listening on (http://127\.0\.0\.1:(\d+)) \(1 engine replica\(s\)\)\n"
        )
        deadline = time.monotonic() + 240
        while True:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if (match := re.fullmatch(pattern, line)) is not None:
                break
        assert int(match[2]) != 0
        assert httpx.get(match[1] + "/health", timeout=30).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)  # drains and shuts the local cluster down
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
