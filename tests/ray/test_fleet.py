"""Two engine replicas on Ray Serve behind one ingress, through real HTTP: mixed concurrent
traffic equals one engine's, prefix affinity holds, and a killed replica fails only its own
requests and comes back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any

import httpx
import pytest

from ..server.server_testing import RunningServer
from .conftest import NUM_REPLICAS
from .fleet_client import generate_all, replica_samples, request_body, wait_for

pytestmark = pytest.mark.slow

# Python text long enough for several full KV pages of the built-in model's tokenizer.
SHARED_PREFIX = "".join(
    f"def function_{index}(value):\n    return value * {index}\n\n" for index in range(12)
)
# Tokens of each request in flight when a replica is killed: 150 take 15 s on the 2-core machine
# (each of a replica's 12 requests gets about 10 tokens/s), while every request is on a replica
# within 2 s, with 4 tokens out, and the kill follows at once. 400 made the test 55 s long: the
# live replica's requests run to their end, and nothing checked depends on how far past the kill
# that is.
KILLED_MAX_TOKENS = 150


def test_64_concurrent_mixed_requests_equal_one_engine(
    fleet: RunningServer, reference: RunningServer
) -> None:
    bodies = [
        request_body(
            index,
            stream=index % 2 == 0,
            chat=index % 4 >= 2,
            prefix=SHARED_PREFIX * (index % 3 == 0),
        )
        for index in range(64)
    ]
    served = asyncio.run(generate_all(fleet, bodies))
    expected = asyncio.run(generate_all(reference, bodies))
    for index, (got, want) in enumerate(zip(served, expected, strict=True)):
        assert got["status"] == 200 and got["error"] is None, (index, got)
        assert got["finish_reason"] == "length", (index, got)
        for field in ("text", "exit_depths", "finish_reason"):
            assert got[field] == want[field], (index, field, got, want)
    assert {result["replica"] for result in served} == {str(index) for index in range(NUM_REPLICAS)}


def test_requests_sharing_a_prefix_go_to_one_replica(fleet: RunningServer) -> None:
    name = "loopserve:requests_finished_total"
    before = replica_samples(fleet, name)
    bodies = [
        request_body(index, stream=index % 2 == 0, chat=False, prefix=SHARED_PREFIX)
        for index in range(8)
    ]

    async def one_by_one() -> list[dict[str, Any]]:  # unloaded replicas: affinity decides
        return [(await generate_all(fleet, [body]))[0] for body in bodies]

    served = asyncio.run(one_by_one())
    (replica,) = {result["replica"] for result in served}

    def counted() -> bool:
        now = replica_samples(fleet, name)
        return now[replica] - before.get(replica, 0) >= len(bodies)

    wait_for(counted, 10, "the replicas' reports")
    after = replica_samples(fleet, name)
    for other in after:
        expected = len(bodies) if other == replica else 0
        assert after[other] - before.get(other, 0) == expected, (other, before, after)
    hits = replica_samples(fleet, "loopserve:prefix_cache_hits_total")
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
        request_body(index, stream=index % 3 != 0, chat=index % 2 == 0)
        | {"max_tokens": KILLED_MAX_TOKENS, "ignore_eos": True}
        for index in range(24)
    ]

    async def run() -> list[dict[str, Any]]:
        pending = asyncio.ensure_future(generate_all(fleet, bodies))

        # Kill only once every request is on a replica: one that reached the ingress after the
        # kill could go to replica 0 and wait there for the restarted replica, which serves it.
        def all_on_replicas() -> bool:
            samples = [
                replica_samples(fleet, f"loopserve:num_requests_{state}")
                for state in ("running", "waiting")
            ]
            on = [
                sum(sample.get(str(index), 0) for sample in samples)
                for index in range(NUM_REPLICAS)
            ]
            return min(on) > 0 and sum(on) == len(bodies)

        await asyncio.to_thread(wait_for, all_on_replicas, 60, "every request on a replica")
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
        return replica_samples(fleet, "loopserve:replica_up").get("0") == 1.0

    wait_for(back, 120, "replica 0 to come back")
    assert handle.report.remote().result(timeout_s=30).pid != pid
