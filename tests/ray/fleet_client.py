"""The Ray tests' HTTP client: request bodies, what came back for each (text, tokens, exit
depths, tokens per streamed event, the replica that answered, errors), and the per-replica
samples of the ingress's /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from ..server.server_testing import RunningServer

REPLICA_HEADER = "x-loopserve-replica"
# Seconds a client waits for the next bytes: a non-streaming answer sends none until it is done,
# which for the killed-replica test's requests on a loaded 2-core machine can take a minute.
CLIENT_TIMEOUT_S = 300


def request_body(index: int, stream: bool, chat: bool, prefix: str = "") -> dict[str, Any]:
    """A short greedy request (6 to 10 tokens) for prompt `index`, after `prefix`."""
    text = f"{prefix}import module_{index % 7}\nclass Thing{index}:\n"
    fields: dict[str, Any] = {"max_tokens": 6 + index % 5, "temperature": 0, "stream": stream}
    if chat:
        return fields | {"messages": [{"role": "user", "content": text}]}
    return fields | {"prompt": text}


async def generate(
    client: httpx.AsyncClient, server: RunningServer, body: dict[str, Any]
) -> dict[str, Any]:
    """What came back for `body`: status, content type, the replica that answered, the text,
    token ids (with `return_token_ids`), exit depths, tokens per choice received (one entry per
    event when streamed) and finish reason, any error (an event or the body) and the body's last
    lines, so that a failed assertion shows the whole answer."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with client.stream(
        "POST", server.url + path, json=body, headers=server.headers
    ) as response:
        lines = [line async for line in response.aiter_lines() if line]
    result: dict[str, Any] = {
        "stream": body["stream"],
        "status": response.status_code,
        "content_type": response.headers.get("content-type", ""),
        "replica": response.headers.get(REPLICA_HEADER),
        "text": "",
        "token_ids": [],
        "exit_depths": [],
        "event_tokens": [],
        "finish_reason": None,
        "error": None,
        "last_lines": lines[-3:],
    }
    if not result["content_type"].startswith("text/event-stream"):
        try:
            data = json.loads("\n".join(lines))
        except ValueError:
            raise AssertionError(f"a body that is not JSON: {result}") from None
        if "error" in data:
            result["error"] = data["error"]
        else:
            _add_choice(result, data["choices"][0])
        return result
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            result["error"] = event["error"]
        elif event["choices"]:
            _add_choice(result, event["choices"][0])
    return result


def _add_choice(result: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice.get("delta")
    result["text"] += (
        (delta.get("content") or "")
        if delta is not None
        else (choice.get("text") or choice["message"]["content"])
    )
    result["token_ids"] += choice.get("token_ids") or []
    result["exit_depths"] += choice["exit_depths"]
    result["event_tokens"].append(len(choice["exit_depths"]))
    result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]


async def generate_all(server: RunningServer, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        return await asyncio.gather(*(generate(client, server, body) for body in bodies))


def replica_samples(server: RunningServer, name: str) -> dict[str, float]:
    """`name`'s per-replica samples on the ingress's /metrics, by replica."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and "replica=" in line:
            labels, value = line.rsplit(" ", 1)
            replica = labels.split('replica="')[1].split('"')[0]
            samples[replica] = samples.get(replica, 0.0) + float(value)
    return samples


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
