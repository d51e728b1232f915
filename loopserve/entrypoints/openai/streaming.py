"""Server-sent events, and noticing that a client went away.

Owns: the SSE framing (`data: <json>\\n\\n`, compact ASCII-only JSON, ending with `data: [DONE]`),
`EventStreamResponse` (streams events while listening for `http.disconnect`, whatever ASGI spec
version the server speaks, and always runs its `on_close` callback), and `unless_disconnected`
for non-streaming responses. Must not: know what the events contain.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE_EVENT = b"data: [DONE]\n\n"
_Result = TypeVar("_Result")


# Events are ASCII-only JSON: generated text may hold U+2028, U+0085 and the like, which many
# clients' line readers (str.splitlines, httpx's iter_lines) would split an event at.


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode() + b"\n\n"


def sse_model_event(model: BaseModel) -> bytes:
    """The event of `sse_event(to_json(model))` (floats may be spelled differently, as 1e-5 for
    1e-05), at about half the cost: pydantic serializes the model without a dict in between."""
    return b"data: " + model.model_dump_json(ensure_ascii=True).encode() + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (call only once the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that stops its event source when the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self._stream(send))
        listening = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, listening):
                task.cancel()
            results = await asyncio.gather(streaming, listening, return_exceptions=True)
            self._on_close()
        if isinstance(results[0], Exception):
            logger.debug("stream ended early: %r", results[0])

    async def _stream(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]


async def unless_disconnected(work: Awaitable[_Result], receive: Receive) -> _Result | None:
    """The result of `work`, or None if the client disconnected first (then `work` is cancelled)."""
    working = asyncio.ensure_future(work)
    listening = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({working, listening}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listening.cancel()
        if not working.done():
            working.cancel()
        await asyncio.gather(working, listening, return_exceptions=True)
    if working.cancelled():
        return None
    return working.result()
