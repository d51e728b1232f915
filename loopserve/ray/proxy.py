"""Relaying a replica's response to the ingress's client.

Owns: `ReplicaResponse`, an ASGI response that sends the parts a replica streams back (status and
headers, with `x-loopserve-replica` added, then an event stream's chunks as they come, any other
answer whole once the replica has sent all of it), cancels the replica's work when the client
disconnects, and turns a replica that fails mid-request into a clear error: a 503 in the OpenAI
error format when nothing was sent yet, else (only an event stream can have started) a last
`error` event and `data: [DONE]`. Must not: import Ray (it is handed the stream and a cancel
function) or retry (a request may have produced output already).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loopserve.entrypoints.openai.errors import OpenAIError
from loopserve.entrypoints.openai.streaming import DONE_EVENT, sse_event, wait_for_disconnect
from loopserve.ray.forwarding import ResponseEnd, ResponsePart, ResponseStart

logger = logging.getLogger(__name__)

REPLICA_HEADER = b"x-loopserve-replica"


def replica_failed(replica: int, error: BaseException) -> OpenAIError:
    return OpenAIError(
        503,
        f"engine replica {replica} failed while serving this request ({type(error).__name__}); "
        "new requests are routed to the other replicas while it restarts, retry",
        error_type="server_error",
        code="replica_failed",
        headers={REPLICA_HEADER.decode(): str(replica)},
    )


class ReplicaResponse(Response):
    def __init__(
        self,
        replica: int,
        parts: AsyncIterator[ResponsePart],
        cancel: Callable[[], None],
        on_failure: Callable[[int], None],
        on_close: Callable[[], None],
    ) -> None:
        """`cancel` stops the replica's work; `on_failure(replica)` when the replica failed;
        `on_close` runs once whatever way the response ends."""
        super().__init__()
        self._replica = replica
        self._parts = parts
        self._cancel = cancel
        self._on_failure = on_failure
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relaying = asyncio.ensure_future(self._relay(scope, receive, send))
        listening = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({relaying, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Relayed to the end; not when sending to the client failed (it left).
            finished = relaying.done() and not relaying.cancelled() and not relaying.exception()
            for task in (relaying, listening):
                task.cancel()
            await asyncio.gather(relaying, listening, return_exceptions=True)
            if not finished:
                self._cancel()  # the client left (or the ingress is stopping)
            self._on_close()

    async def _relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        # An event stream is relayed as it comes; any other answer is held until it is complete,
        # so that a replica dying mid-answer gives its client the 503, not a cut 200.
        streaming = started = False
        held: list[ResponseStart | bytes] = []
        parts = aiter(self._parts)
        while True:
            try:
                part = await anext(parts)
            except StopAsyncIteration:
                # Cut before the app's end (a killed actor's stream can stop without raising).
                cut = ConnectionError("the replica's response stopped before its end")
                await self._fail(cut, started, scope, receive, send)
                return
            except Exception as error:  # the replica failed (errors of `send` are the client's)
                await self._fail(error, started, scope, receive, send)
                return
            if isinstance(part, ResponseEnd):
                break
            if isinstance(part, ResponseStart):
                content_type = part.header(b"content-type") or b""
                streaming = content_type.startswith(b"text/event-stream")
            if streaming:
                started = True
                await self._send(part, send)
            else:
                held.append(part)
        for part in held:
            await self._send(part, send)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, part: ResponseStart | bytes, send: Send) -> None:
        if isinstance(part, ResponseStart):
            headers = [*part.headers, (REPLICA_HEADER, str(self._replica).encode())]
            await send({"type": "http.response.start", "status": part.status, "headers": headers})
        else:
            await send({"type": "http.response.body", "body": part, "more_body": True})

    async def _fail(
        self, error: Exception, started: bool, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """End the response with `error` in the OpenAI format: a 503 when nothing was sent yet,
        else (an event stream has started) an `error` event and `data: [DONE]`."""
        logger.warning("engine replica %d failed mid-request: %r", self._replica, error)
        self._on_failure(self._replica)
        failure = replica_failed(self._replica, error)
        if not started:
            await failure.response()(scope, receive, send)
            return
        body = sse_event(failure.body()) + DONE_EVENT
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
