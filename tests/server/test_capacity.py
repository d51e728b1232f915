"""Serving capacity through real HTTP: 256 concurrent streaming chats with no max_tokens, on a KV
cache where reserving every request's worst case would admit fewer than 8 at a time. With pages
taken as tokens arrive (and preemption when they run out) every chat completes without an error,
and the cache is empty again afterwards."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.pressure import PREEMPTING

from .server_testing import RunningServer, serve_in_thread, write_tiny_model

NUM_CHATS = 256
# No max_tokens: a chat may run to the end of its context. 56, not 64: still 4 pages of 16 per
# plane for a worst case, so the arithmetic below is the same, but prompts are about 45 tokens and
# 8 fewer tokens each cut the engine steps from 2,950 to 1,630 (33 s -> 26 s); pages still run
# out (40 preemptions, as with 64).
MAX_MODEL_LEN = 56
NUM_KV_PAGES = 100  # 99 usable; a worst case is 4 pages x 4 planes = 16 pages: 6 fit


async def _chat(http: httpx.AsyncClient, server: RunningServer, index: int) -> tuple[str, int]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Chat {index}: tell me about the fox"}],
        "stream": True,
        "seed": index,
    }
    finish, tokens = "", 0
    request = http.stream("POST", "/v1/chat/completions", json=body, headers=server.headers)
    async with request as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                tokens += len(choice.get("exit_depths") or [])
                finish = choice.get("finish_reason") or finish
    return finish, tokens


async def _all_chats(server: RunningServer) -> list[tuple[str, int]]:
    limits = httpx.Limits(max_connections=NUM_CHATS)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
        return await asyncio.gather(*(_chat(http, server, index) for index in range(NUM_CHATS)))


@pytest.mark.slow
def test_256_chats_without_max_tokens_all_complete(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model", max_model_len=MAX_MODEL_LEN)
    engine = {"num_kv_pages": NUM_KV_PAGES, "max_num_seqs": 32, **PREEMPTING}
    with serve_in_thread(model, engine=engine) as server:
        results = asyncio.run(_all_chats(server))
        samples = server.wait_until_idle()
    assert all(finish in ("stop", "length") for finish, _ in results), results
    assert all(tokens >= 1 for _, tokens in results)
    # More than the 6 requests a reservation of every worst case would allow ran at once, and
    # pages ran out: requests were preempted and resumed.
    assert samples["loopserve:num_preemptions_total"] > 0
    assert samples["loopserve:kv_pages_used"] == 0
    assert samples["loopserve:num_requests_running"] == 0
