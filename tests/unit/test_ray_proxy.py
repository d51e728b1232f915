"""Forwarding a request to a replica's app and relaying its answer, without Ray: a failing
replica ends the response with a clear error, a leaving client cancels the replica's work."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the ingress needs the `serve` extra")

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from loopserve.ray.forwarding import (
    RESPONSE_END,
    ForwardedRequest,
    ResponsePart,
    ResponseStart,
    call_app,
)
from loopserve.ray.proxy import ReplicaResponse

SSE = [(b"content-type", b"text/event-stream")]


class Relay:
    """Runs a `ReplicaResponse` over `parts`, recording what it sent and the callbacks."""

    def __init__(self, parts: AsyncIterator[ResponsePart]) -> None:
        self.sent: list[dict[str, Any]] = []
        self.cancelled = self.closed = False
        self.failed: list[int] = []
        self.response = ReplicaResponse(3, parts, self._cancel, self.failed.append, self._close)

    def _cancel(self) -> None:
        self.cancelled = True

    def _close(self) -> None:
        self.closed = True

    async def run(self, disconnect: asyncio.Event | None = None) -> None:
        leave = disconnect or asyncio.Event()

        async def receive() -> dict[str, Any]:
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            self.sent.append(message)

        await self.response({"type": "http"}, receive, send)

    @property
    def body(self) -> bytes:
        return b"".join(item.get("body", b"") for item in self.sent[1:])


async def _parts(*items: ResponsePart, fail: bool = False) -> AsyncIterator[ResponsePart]:
    for item in items:
        yield item
    if fail:
        raise RuntimeError("actor died")


def test_a_complete_answer_is_relayed_as_it_came() -> None:
    relay = Relay(_parts(ResponseStart(200, SSE), b"data: {}\n\n", RESPONSE_END))
    asyncio.run(relay.run())
    assert relay.sent[0]["status"] == 200 and relay.body == b"data: {}\n\n"
    assert relay.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert relay.closed and not relay.failed and not relay.cancelled


def test_a_stream_that_stops_before_the_end_marker_ends_with_an_error_event() -> None:
    """Ray may end a killed replica's stream quietly: without the end marker it is a failure."""
    relay = Relay(_parts(ResponseStart(200, SSE), b"data: {}\n\n"))
    asyncio.run(relay.run())
    events = relay.body.split(b"\n\n")
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == "replica_failed" and events[2] == b"data: [DONE]"
    assert relay.failed == [3] and relay.closed


def test_a_replica_failing_mid_stream_ends_the_stream_with_an_error_event() -> None:
    relay = Relay(_parts(ResponseStart(200, SSE), b"data: {}\n\n", fail=True))
    asyncio.run(relay.run())
    assert relay.sent[0]["status"] == 200
    assert (b"x-loopserve-replica", b"3") in relay.sent[0]["headers"]
    events = relay.body.split(b"\n\n")
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == "replica_failed" and "replica 3 failed" in error["message"]
    assert events[2] == b"data: [DONE]"
    assert relay.failed == [3] and relay.closed and not relay.cancelled


def test_a_replica_failing_before_answering_gives_a_503() -> None:
    relay = Relay(_parts(fail=True))
    asyncio.run(relay.run())
    assert relay.sent[0]["status"] == 503
    assert (b"x-loopserve-replica", b"3") in relay.sent[0]["headers"]
    assert json.loads(relay.body)["error"]["type"] == "server_error"


def test_an_answer_that_is_not_a_stream_comes_whole_or_as_a_503() -> None:
    """A replica dying between a JSON answer's start and its body must not leave a cut 200."""
    json_start = ResponseStart(200, [(b"content-type", b"application/json")])
    whole = Relay(_parts(json_start, b'{"id": ', b"1}", RESPONSE_END))
    asyncio.run(whole.run())
    assert whole.sent[0]["status"] == 200 and json.loads(whole.body) == {"id": 1}
    for parts in (_parts(json_start, fail=True), _parts(json_start, b'{"id": ')):
        cut = Relay(parts)
        asyncio.run(cut.run())
        assert [message.get("status") for message in cut.sent[:1]] == [503]
        assert json.loads(cut.body)["error"]["code"] == "replica_failed"
        assert cut.failed == [3] and cut.closed


def test_a_client_that_leaves_cancels_the_replicas_work() -> None:
    async def endless() -> AsyncIterator[ResponsePart]:
        yield ResponseStart(200, SSE)
        while True:
            await asyncio.sleep(0.01)
            yield b"data: {}\n\n"

    async def scenario() -> Relay:
        relay = Relay(endless())
        leave = asyncio.Event()
        asyncio.get_running_loop().call_later(0.1, leave.set)
        await relay.run(leave)
        return relay

    relay = asyncio.run(scenario())
    assert relay.cancelled and relay.closed and not relay.failed


def test_call_app_streams_the_apps_answer_and_tells_it_when_the_client_left() -> None:
    app = FastAPI()
    finished: list[str] = []

    @app.post("/echo")
    async def echo(request: Request) -> StreamingResponse:
        body = await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            try:
                for _ in range(1000):
                    yield body
                    await asyncio.sleep(0.01)
            finally:
                finished.append("closed")

        return StreamingResponse(chunks(), media_type="text/plain")

    async def scenario() -> list[ResponsePart]:
        parts = call_app(app, ForwardedRequest("POST", "/echo", body=b"ping"))
        received = [await anext(parts), await anext(parts), await anext(parts)]
        await parts.aclose()  # the ingress cancelled: the app must stop
        return received

    start, first, second = asyncio.run(scenario())
    assert isinstance(start, ResponseStart) and start.status == 200
    assert first == second == b"ping"
    assert finished == ["closed"]


def test_a_client_whose_connection_breaks_cancels_the_replicas_work() -> None:
    relay = Relay(_parts(ResponseStart(200, SSE), b"data: {}\n\n", b"data: {}\n\n", RESPONSE_END))

    async def broken_send(message: dict[str, Any]) -> None:
        if message.get("body"):
            raise OSError("connection reset")

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    asyncio.run(relay.response({"type": "http"}, never, broken_send))  # ends quietly
    assert relay.cancelled and relay.closed and not relay.failed
