"""Two engine replicas on Ray Serve behind one ingress, through real HTTP: mixed concurrent
traffic equals one engine's, prefix affinity holds, and a killed replica fails only its own
requests and comes back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import pytest

from ..server.server_testing import RunningServer
from .conftest import NUM_REPLICAS

pytestmark = pytest.mark.slow

# Python text long enough for several full KV pages of the built-in model's tokenizer.
SHARED_PREFIX = "".join(
    f"def function_{index}(value):\n    return value * {index}\n\n" for index in range(12)
)
REPLICA_HEADER = "x-loopserve-replica"
# Seconds a client waits for the next bytes: a non-streaming answer sends none until it is done,
# which for the killed-replica test's requests on a loaded 2-core machine can take a minute.
CLIENT_TIMEOUT_S = 300
# Tokens of each request in flight when a replica is killed: 150 take 15 s on the 2-core machine
# (each of a replica's 12 requests gets about 10 tokens/s), while every request is on a replica
# within 2 s, with 4 tokens out, and the kill follows at once. 400 made the test 55 s long: the
# live replica's requests run to their end, and nothing checked depends on how far past the kill
# that is.
KILLED_MAX_TOKENS = 150


def _body(index: int, stream: bool, chat: bool, prefix: str = "") -> dict[str, Any]:
    text = f"{prefix}import module_{index % 7}\nclass Thing{index}:\n"
    fields: dict[str, Any] = {"max_tokens": 6 + index % 5, "temperature": 0, "stream": stream}
    if chat:
        return fields | {"messages": [{"role": "user", "content": text}]}
    return fields | {"prompt": text}


async def _generate(
    client: httpx.AsyncClient, server: RunningServer, body: dict[str, Any]
) -> dict[str, Any]:
    """What came back for `body`: status, content type, the replica that answered, the text,
    exit depths and finish reason (streamed or not), any error (an event or the body) and the
    body's last lines, so that a failed assertion shows the whole answer."""
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
        "exit_depths": [],
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
    result["exit_depths"] += choice.get("exit_depths") or []
    result["finish_reason"] = choice["finish_reason"] or result["finish_reason"]


async def _all(server: RunningServer, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        return await asyncio.gather(*(_generate(client, server, body) for body in bodies))


def _replica_samples(server: RunningServer, name: str) -> dict[str, float]:
    """`name`'s per-replica samples on the ingress's /metrics, by replica."""
    text = httpx.get(f"{server.url}/metrics", headers=server.headers, timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and "replica=" in line:
            labels, value = line.rsplit(" ", 1)
            replica = labels.split('replica="')[1].split('"')[0]
            samples[replica] = samples.get(replica, 0.0) + float(value)
    return samples


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_64_concurrent_mixed_requests_equal_one_engine(
    fleet: RunningServer, reference: RunningServer
) -> None:
    bodies = [
        _body(
            index,
            stream=index % 2 == 0,
            chat=index % 4 >= 2,
            prefix=SHARED_PREFIX * (index % 3 == 0),
        )
        for index in range(64)
    ]
    served = asyncio.run(_all(fleet, bodies))
    expected = asyncio.run(_all(reference, bodies))
    for index, (got, want) in enumerate(zip(served, expected, strict=True)):
        assert got["status"] == 200 and got["error"] is None, (index, got)
        assert got["finish_reason"] == "length", (index, got)
        for field in ("text", "exit_depths", "finish_reason"):
            assert got[field] == want[field], (index, field, got, want)
    assert {result["replica"] for result in served} == {str(index) for index in range(NUM_REPLICAS)}


def test_requests_sharing_a_prefix_go_to_one_replica(fleet: RunningServer) -> None:
    name = "loopserve:requests_finished_total"
    before = _replica_samples(fleet, name)
    bodies = [
        _body(index, stream=index % 2 == 0, chat=False, prefix=SHARED_PREFIX) for index in range(8)
    ]

    async def one_by_one() -> list[dict[str, Any]]:  # unloaded replicas: affinity decides
        return [(await _all(fleet, [body]))[0] for body in bodies]

    served = asyncio.run(one_by_one())
    (replica,) = {result["replica"] for result in served}

    def counted() -> bool:
        now = _replica_samples(fleet, name)
        return now[replica] - before.get(replica, 0) >= len(bodies)

    _wait_for(counted, 10, "the replicas' reports")
    after = _replica_samples(fleet, name)
    for other in after:
        expected = len(bodies) if other == replica else 0
        assert after[other] - before.get(other, 0) == expected, (other, before, after)
    hits = _replica_samples(fleet, "loopserve:prefix_cache_hits_total")
    assert hits[replica] >= (len(bodies) - 1) * 16  # every later request found the prefix pages


def test_the_ingress_checks_the_key_and_serves_models_and_health(fleet: RunningServer) -> None:
    assert httpx.get(f"{fleet.url}/v1/models", timeout=10).status_code == 401
    models = httpx.get(f"{fleet.url}/v1/models", headers=fleet.headers, timeout=30)
    assert [card["id"] for card in models.json()["data"]] == ["tiny"]
    assert httpx.get(f"{fleet.url}/health", timeout=10).status_code == 200
    too_big = httpx.post(
        f"{fleet.url}/v1/completions", content=b"x" * (9 * 2**20), headers=fleet.headers, timeout=30
    )
    assert too_big.status_code == 413 and "error" in too_big.json()


def test_a_killed_replica_fails_only_its_requests_and_comes_back(fleet: RunningServer) -> None:
    from ray import serve

    handle = serve.get_deployment_handle("loopserve-engine-0", app_name="loopserve")
    pid = handle.report.remote().result(timeout_s=30).pid
    bodies = [
        _body(index, stream=index % 3 != 0, chat=index % 2 == 0)
        | {"max_tokens": KILLED_MAX_TOKENS, "ignore_eos": True}
        for index in range(24)
    ]

    async def run() -> list[dict[str, Any]]:
        pending = asyncio.ensure_future(_all(fleet, bodies))

        # Kill only once every request is on a replica: one that reached the ingress after the
        # kill could go to replica 0 and wait there for the restarted replica, which serves it.
        def all_on_replicas() -> bool:
            samples = [
                _replica_samples(fleet, f"loopserve:num_requests_{state}")
                for state in ("running", "waiting")
            ]
            on = [
                sum(sample.get(str(index), 0) for sample in samples)
                for index in range(NUM_REPLICAS)
            ]
            return min(on) > 0 and sum(on) == len(bodies)

        await asyncio.to_thread(_wait_for, all_on_replicas, 60, "every request on a replica")
        os.kill(pid, signal.SIGKILL)
        return await pending

    served = asyncio.run(run())
    on_dead = [result for result in served if result["replica"] == "0"]
    on_live = [result for result in served if result["replica"] != "0"]
    assert on_dead and on_live
    for result in on_live:
        assert result["status"] == 200 and result["error"] is None, result
        assert (
            result["finish_reason"] == "length" and len(result["exit_depths"]) == KILLED_MAX_TOKENS
        ), result
    for result in on_dead:
        # Nothing sent yet: a 503 with an error body. A started stream: an error event, then
        # [DONE]. The error says which replica failed.
        if result["status"] == 503:
            assert result["content_type"] == "application/json", result
        else:
            assert result["stream"] and result["status"] == 200, result
            assert result["last_lines"][-1] == "data: [DONE]", result
            assert "error" in json.loads(result["last_lines"][-2].removeprefix("data: ")), result
        assert result["error"] is not None and result["error"]["code"] == "replica_failed", result
        assert "replica 0 failed" in result["error"]["message"], result

    # Serve restarts it; the ingress routes to it again once it answers a poll.
    def back() -> bool:
        return _replica_samples(fleet, "loopserve:replica_up").get("0") == 1.0

    _wait_for(back, 120, "replica 0 to come back")
    assert handle.report.remote().result(timeout_s=30).pid != pid
