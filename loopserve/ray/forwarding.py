"""An HTTP request carried from the ingress to a replica, and the replica's response coming back.

Owns: `ForwardedRequest` (what the ingress read of a client's request), `ResponseStart` (status and
headers) and `call_app`, which runs an ASGI app in-process on a forwarded request and yields its
response as it is sent: one `ResponseStart`, then body chunks (each SSE event its own chunk),
then `RESPONSE_END` once the app has finished.
Closing the iterator early (the client left, the ingress cancelled) tells the app the client
disconnected and waits for it to finish, so whatever the request started is aborted and freed.
Must not: import Ray or know the routes (the app answers the request as it would over HTTP).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

# Seconds an app may take to wind down once its client is gone, before it is cancelled.
CLOSE_TIMEOUT_S = 10.0

Headers = list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: Headers = field(default_factory=list)
    body: bytes = b""

    def scope(self) -> dict[str, Any]:
        """The ASGI HTTP scope of this request (no client or server address: it came by Ray)."""
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": self.method,
            "scheme": "http",
            "path": self.path,
            "raw_path": self.path.encode(),
            "query_string": self.query_string,
            "root_path": "",
            "headers": self.headers,
            "client": None,
            "server": None,
            "state": {},
        }


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: Headers

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)


@dataclass(frozen=True, slots=True)
class ResponseEnd:
    """The last part of a response the app sent to its end. A stream of parts that stops
    without it was cut (Ray can end a dead actor's stream quietly instead of raising)."""


RESPONSE_END = ResponseEnd()
ResponsePart = ResponseStart | ResponseEnd | bytes


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponsePart]:
    """Run `app` on `request`, yielding the response as the app sends it.

    Raises:
        Exception: whatever the app raised (apps with error handlers answer instead).
    """
    parts: asyncio.Queue[ResponsePart | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_read = False

    async def receive() -> Message:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(bytes(key), bytes(value)) for key, value in message.get("headers", [])]
            parts.put_nowait(ResponseStart(message["status"], headers))
        elif message["type"] == "http.response.body" and message.get("body"):
            parts.put_nowait(bytes(message["body"]))

    async def run() -> None:
        try:
            await app(request.scope(), receive, send)
        finally:
            parts.put_nowait(None)

    task = asyncio.ensure_future(run())
    try:
        while (part := await parts.get()) is not None:
            yield part
        await task  # raises what the app raised
        yield RESPONSE_END
    finally:
        disconnected.set()
        if not task.done():
            await asyncio.wait({task}, timeout=CLOSE_TIMEOUT_S)
            task.cancel()
