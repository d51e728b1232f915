"""The CLI as a user runs it: `python -m loopserve.entrypoints.cli` in a subprocess that imports
this checkout, and `loopserve serve` started and stopped around a block."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLI = [sys.executable, "-m", "loopserve.entrypoints.cli"]


def environment() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return os.environ | {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(model_dir: Path, *flags: str, timeout_s: float = 300) -> Iterator[str]:
    """`loopserve serve --model DIR FLAGS` until healthy; yields its base URL (`.../v1`)."""
    import httpx

    port = free_port()
    command = [*CLI, "serve", "--model", str(model_dir), "--port", str(port), *flags]
    server = subprocess.Popen(
        command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert server.poll() is None, server.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=60)
