"""A fleet mounted below a prefix (`serve.run(app, route_prefix="/api")`): the ingress forwards
the path below the prefix to the replicas (mounted at "/"), so generation, /v1/models, /health
and /metrics answer under /api, streamed or not, as a fleet at "/" does; the key check and the
concurrency limit see the same paths."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from ..server.server_testing import RunningServer
from .conftest import ENGINE_OPTIONS, running_fleet
from .fleet_client import generate_all, request_body, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mounted(serve_port: int) -> Iterator[RunningServer]:
    with running_fleet(serve_port, ENGINE_OPTIONS, route_prefix="/api") as running:
        yield running


def test_a_fleet_below_a_prefix_answers_there(mounted: RunningServer) -> None:
    assert mounted.url.endswith("/api")
    bodies = [request_body(index, stream=index % 2 == 0, chat=index % 4 >= 2) for index in range(8)]
    for index, result in enumerate(asyncio.run(generate_all(mounted, bodies))):
        assert result["status"] == 200 and result["error"] is None, (index, result)
        assert result["finish_reason"] == "length" and result["text"], (index, result)
    models = httpx.get(f"{mounted.url}/v1/models", headers=mounted.headers, timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{mounted.url}/health", timeout=10).status_code == 200  # no key needed
    unauthorized = httpx.post(f"{mounted.url}/v1/completions", json=bodies[1], timeout=10)
    assert unauthorized.status_code == 401

    def finished() -> list[str]:
        text = httpx.get(f"{mounted.url}/metrics", headers=mounted.headers, timeout=10).text
        name = 'loopserve:requests_finished_total{finish_reason="length"} '
        return [line.removeprefix(name) for line in text.splitlines() if line.startswith(name)]

    # The ingress's counts come from its replicas' reports, polled every 0.2 s.
    wait_for(lambda: finished() == [str(len(bodies))], 10, "the finished requests counted")
