"""Helpers of the HTTP server tests: a tiny checkpoint with a real tokenizer and chat template,
servers running uvicorn on a free loopback port in a thread, and `loopserve serve` as a real
subprocess, reached through real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

API_KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 64 * 1024
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Text with multi-byte characters, so byte-level tokens split UTF-8 sequences.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café, ünïcode façade. " * 8,
    "日本語のテキストと中文文本，还有表情符号 🙂🚀 and Ελληνικά γράμματα, русский текст. " * 8,
    "def add(x, y):\n    return x + y\n\nfor item in range(10):\n    print(item)\n" * 8,
]


def engine_options() -> dict[str, Any]:
    """EngineConfig options every test engine uses (small KV cache: fast to allocate)."""
    return {"num_kv_pages": 2048, "max_num_seqs": 64, "seed": 0}


def write_tiny_model(directory: Path, max_model_len: int = MAX_MODEL_LEN) -> Path:
    from loopserve.data.corpus import CorpusFile
    from loopserve.models.checkpoint_writer import write_random_checkpoint
    from loopserve.models.ouro_config import OuroConfig
    from loopserve.train.tokenizer_training import save_tokenizer, train_tokenizer

    files = [CorpusFile(f"text{index}", text) for index, text in enumerate(_CORPUS)]
    tokenizer = train_tokenizer(files, vocab_size=400)
    config = OuroConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_model_len,
    )
    write_random_checkpoint(directory, config)
    save_tokenizer(tokenizer, directory)
    tokenizer_config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


@dataclass(frozen=True)
class RunningServer:
    url: str  # http://127.0.0.1:PORT
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name."""
        response = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10)
        response.raise_for_status()
        samples = {}
        for line in response.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_until_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Metrics once no request runs or waits (aborts are applied asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            running = samples["loopserve:num_requests_running"]
            idle = running + samples["loopserve:num_requests_waiting"] == 0
            if idle or time.monotonic() > deadline:
                return samples
            time.sleep(0.05)


@contextmanager
def serve_in_thread(
    model: Path,
    engine: dict[str, Any] | None = None,
    *,
    engine_process: bool = False,
    **server_options: Any,
) -> Iterator[RunningServer]:
    """Run `loopserve serve` in-process on a free port until the block ends (`engine`: engine
    options that replace `engine_options()`'s). The engine runs in a thread of this process, as
    `--no-engine-process`, unless `engine_process` (the server's default, a spawned child: each
    takes a second or two to start, so only the tests about it ask for it)."""
    import uvicorn

    from loopserve.config import EngineConfig
    from loopserve.engine.engine import Engine
    from loopserve.entrypoints.openai.app import build_app
    from loopserve.entrypoints.openai.config import ServerConfig
    from loopserve.entrypoints.openai.engine_process import EngineChild
    from loopserve.entrypoints.openai.server import bind_socket, uvicorn_config

    config = ServerConfig(
        served_model_names=("tiny",),
        log_level="warning",
        engine_process=engine_process,
        **server_options,
    )
    options = engine_options() | (engine or {})
    engine_config = EngineConfig.from_options(model=str(model), **options)
    built = EngineChild.spawn(engine_config) if config.engine_process else Engine(engine_config)
    app = build_app(built, config)
    server = uvicorn.Server(uvicorn_config(app, config))
    sock = bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield RunningServer(f"http://127.0.0.1:{sock.getsockname()[1]}", config.api_key)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


# Runs the `loopserve` command in a subprocess without an installed script.
CLI = "import sys; from loopserve.entrypoints.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_processes(parent: int) -> list[int]:
    """Pids of `parent`'s children started by multiprocessing's spawn (an engine process)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline") as cmdline:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                if ppid == parent and "spawn_main" in cmdline.read():
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def sigint_as_default() -> None:
    """`preexec_fn` of a child that must see Ctrl-C: a shell's background job (a CI script started
    with `&`, say) runs with SIGINT ignored, children inherit that, and Python then leaves it
    ignored instead of raising KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_serve_process(
    model: Path, port: int, *flags: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """`loopserve serve --model MODEL --port PORT FLAGS...` (`env` added to this process's
    environment), once /health answers 200. Without `--no-engine-process` in FLAGS its engine
    runs in a process of its own, the default."""
    command = [
        sys.executable, "-c", CLI, "serve", "--model", str(model), "--port", str(port),
        "--served-model-name", "tiny", "--uvicorn-log-level", "warning", *flags,
    ]  # fmt: skip
    environment = {**os.environ, **(env or {})}
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=environment,
        preexec_fn=sigint_as_default,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server did not start: {process.communicate()[1].decode()[-2000:]}")
