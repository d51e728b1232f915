"""Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Owns: `OpenAIError` (raised anywhere in the server layer with its HTTP status), the error body,
and the handlers that turn exceptions into that body. Must not: decide when a request is bad
(callers do), or leak internal details of unexpected failures to clients.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    """A client-visible failure with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    param = None if param is None else _encodable(param)
    return {
        "error": {"message": _encodable(message), "type": error_type, "param": param, "code": code}
    }


def _encodable(text: str) -> str:
    """`text` with any lone surrogate (from a client's JSON) escaped, so UTF-8 can encode it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns, including unknown routes and crashes, in the OpenAI shape."""

    async def on_openai_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, OpenAIError)
        return error.response()

    async def on_http_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        phrase = HTTPStatus(error.status_code).phrase
        message = error.detail if isinstance(error.detail, str) else phrase
        body = error_body(message, "invalid_request_error", code=phrase.lower().replace(" ", "_"))
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        body = error_body(f"internal server error ({type(error).__name__})", "server_error")
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
