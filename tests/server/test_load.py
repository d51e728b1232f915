"""Load and disconnects through real HTTP: 64 concurrent streaming clients, a random quarter of
them leaving mid-stream. Every other request completes, the leavers' requests are aborted (not run
to the end), no KV page stays in use, and /health answers 200 throughout. A client that leaves a
non-streamed request aborts it too."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx
import pytest

from .server_testing import RunningServer

NUM_CLIENTS = 64
NUM_LEAVERS = NUM_CLIENTS // 4
MAX_TOKENS = 8
LEAVER_MAX_TOKENS = 200  # far more than they wait for: only an abort ends them early
ABORTED = 'loopserve:requests_finished_total{finish_reason="abort"}'
LENGTH = 'loopserve:requests_finished_total{finish_reason="length"}'


@dataclass
class StreamResult:
    num_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False  # saw `data: [DONE]`


async def _stream(
    http: httpx.AsyncClient, server: RunningServer, index: int, leave: bool
) -> StreamResult:
    body = {
        "model": "tiny",
        "prompt": f"Request number {index}: the quick brown fox",
        "max_tokens": LEAVER_MAX_TOKENS if leave else MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    result = StreamResult()
    request = http.stream("POST", "/v1/completions", json=body, headers=server.headers)
    async with request as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                result.done = True
                break
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            result.num_tokens += len(choice["exit_depths"])
            result.finish_reason = choice["finish_reason"]
            if leave and result.num_tokens >= 2:
                break  # leaving the block closes the connection mid-stream
    return result


async def _health_while(
    server: RunningServer, clients: asyncio.Future[list[StreamResult]]
) -> list[int]:
    statuses = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        while not clients.done():
            statuses.append((await http.get("/health")).status_code)
            await asyncio.sleep(0.05)
    return statuses


async def _run(server: RunningServer, leavers: set[int]) -> tuple[list[StreamResult], list[int]]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        clients = asyncio.gather(
            *(_stream(http, server, index, index in leavers) for index in range(NUM_CLIENTS))
        )
        statuses = await _health_while(server, clients)
        return await clients, statuses


def test_64_streams_with_a_quarter_disconnecting(server: RunningServer) -> None:
    before = server.wait_until_idle()
    leavers = set(random.Random(0).sample(range(NUM_CLIENTS), NUM_LEAVERS))
    results, health = asyncio.run(_run(server, leavers))
    after = server.wait_until_idle()
    for index, result in enumerate(results):
        if index in leavers:
            assert result.finish_reason is None and not result.done
        else:
            assert (result.num_tokens, result.finish_reason, result.done) == (
                MAX_TOKENS,
                "length",
                True,
            ), index
    assert health and set(health) == {200}
    assert after["loopserve:num_requests_running"] == 0
    assert after["loopserve:num_requests_waiting"] == 0
    assert after["loopserve:kv_pages_used"] == 0
    assert after["loopserve:kv_pages_free"] == after["loopserve:kv_pages_total"]
    assert after[ABORTED] - before[ABORTED] == NUM_LEAVERS
    assert after[LENGTH] - before[LENGTH] == NUM_CLIENTS - NUM_LEAVERS
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_client_leaving_a_non_streamed_request_aborts_it(server: RunningServer) -> None:
    before = server.wait_until_idle()
    body = {"model": "tiny", "prompt": "x", "max_tokens": 240, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 240 tokens
        httpx.post(f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=0.3)
    after = server.wait_until_idle()
    assert after[ABORTED] - before[ABORTED] == 1
    assert after[LENGTH] == before[LENGTH]
    assert after["loopserve:kv_pages_used"] == 0
