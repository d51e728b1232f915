"""API-key authentication: `Authorization: Bearer <key>` on every path but /health.

Owns: `ApiKeyMiddleware` (pure ASGI, so it also guards unknown paths and streaming responses,
comparing keys in constant time). Must not: log or echo keys.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from loopserve.entrypoints.openai.errors import OpenAIError
from loopserve.entrypoints.openai.paths import route_path

OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and route_path(scope) not in OPEN_PATHS
        if guarded and not self._authorized(scope):
            error = OpenAIError(
                401,
                "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                error_type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False
