"""`loopserve serve` says where it listens: one line on stdout, with the port really bound (so
`--port 0` can be found), once the server accepts connections."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading

import httpx

from .server_testing import CLI


def test_serve_prints_the_address_it_listens_on() -> None:
    command = [
        sys.executable, "-c", CLI, "serve", "--model", "ouro-tiny", "--port", "0",
        "--device", "cpu", "--num-kv-pages", "64", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
