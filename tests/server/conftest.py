"""Fixtures of the HTTP server tests: the tiny checkpoint and the shared server (started once per
session), with `openai` clients pointed at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server tests need the `serve` extra")
pytest.importorskip("openai", reason="the server tests drive the server with the openai client")

from .server_testing import (
    API_KEY,
    MAX_REQUEST_BYTES,
    RunningServer,
    serve_in_thread,
    write_tiny_model,
)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("ouro-tiny-server"))


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[RunningServer]:
    """The shared server: API key required, 100 concurrent requests, 64 KiB bodies."""
    with serve_in_thread(
        tiny_model,
        api_key=API_KEY,
        max_concurrent_requests=100,
        max_request_bytes=MAX_REQUEST_BYTES,
    ) as running:
        yield running


@pytest.fixture(scope="session")
def client(server: RunningServer):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
