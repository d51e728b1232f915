"""Hard limits on what one client can ask of the server.

Owns: `ConcurrencyLimitMiddleware` (pure ASGI: at most N generation requests in flight, counted
until their response, streamed or not, has ended; more get 429 with `Retry-After`) and
`read_json_body` (the body within its size limit, 413 beyond, 400 when it is not JSON). Must not:
validate fields (protocol models do) or block the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from loopserve.entrypoints.openai.errors import OpenAIError, bad_request

# Seconds a client told 429 should wait before it retries.
RETRY_AFTER_S = 1


class ConcurrencyLimitMiddleware:
    def __init__(self, app: ASGIApp, limit: int, paths: Iterable[str]) -> None:
        self.app = app
        self.limit = limit
        self.paths = frozenset(paths)
        self.in_flight = 0  # touched only on the event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            error = OpenAIError(
                429,
                f"too many concurrent requests: the limit is {self.limit}; retry later",
                error_type="rate_limit_error",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
            await error.response()(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def read_json_body(request: Request, limit: int) -> Any:
    """The parsed JSON body; 413 past `limit` bytes (checked before and while reading)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect:
        raise bad_request("the client disconnected while sending the body") from None
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large"
    )
