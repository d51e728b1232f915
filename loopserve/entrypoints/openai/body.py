"""The request body: its bytes within the size limit, then JSON within the structural limits.

Owns: `read_body` (413 past `--max-request-bytes`, checked from Content-Length and while
reading) and `parse_json_body`: a JSON object, or a 400 for what is not one, for nesting deeper
than `--max-json-depth`, a number longer than `--max-json-number-digits` or not finite (`NaN`,
`Infinity`, `1e999`: JSON has no such numbers), more objects than `--max-json-objects`, and a lone
UTF-16 surrogate (`"\\ud800"`) in any string or key, which neither a tokenizer nor a response can
encode. Each error names the limit, and `param` the field where the problem is. Must not:
validate fields (protocol models do). `read_body` runs on the event loop; `parse_json_body` is CPU
work for a worker thread, and its cost grows with the body, never with its nesting or numbers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from loopserve.entrypoints.openai.errors import OpenAIError, bad_request

# A lone UTF-16 surrogate: a str can hold one (JSON's "\ud800"), UTF-8 cannot encode it. Only
# an escape in the body can put one there (the decoder refuses encoded surrogates).
_SURROGATE = re.compile("[\ud800-\udfff]")
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True, slots=True)
class BodyLimits:
    max_depth: int  # containers nested in one another, the body itself included
    max_number_digits: int  # characters of one number literal
    max_objects: int  # JSON objects in the whole body


async def read_body(request: Request, limit: int) -> bytes:
    """The body's bytes; 413 past `limit` bytes (checked before and while reading)."""
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
    return bytes(body)


def parse_json_body(body: bytes, limits: BodyLimits) -> dict[str, Any]:
    """The body as a JSON object; a 400 OpenAIError naming the problem and where it is."""
    if not body:
        raise bad_request("the request body is empty; send a JSON object")
    numbers = _NumberParser(limits.max_number_digits)
    objects = _ObjectCounter(limits.max_objects)
    try:
        value = json.loads(
            body,
            parse_int=numbers.integer,
            parse_float=numbers.real,
            parse_constant=numbers.constant,
            object_hook=objects.count,
        )
    except RecursionError:
        raise _too_deep(limits.max_depth, ()) from None
    except _TooManyObjects:
        message = f"the JSON body holds more than {limits.max_objects} objects (--max-json-objects)"
        raise bad_request(message) from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise bad_request("the request body must be a JSON object")
    strings = _ESCAPED_SURROGATE.search(body) is not None  # else no string can hold one
    _check_structure(value, limits, strings, numbers.rejected)
    return value


class _Rejected:
    """A number the parser refused; the structure check reports it with its place."""

    def __init__(self, literal: str, reason: str = "JSON numbers must be finite") -> None:
        self.literal = literal
        self.reason = reason


class _TooManyObjects(Exception):
    pass


class _ObjectCounter:
    """Stops the parser at the first object past the limit, before it builds the rest."""

    def __init__(self, max_objects: int) -> None:
        self._left = max_objects

    def count(self, value: dict[str, Any]) -> dict[str, Any]:
        self._left -= 1
        if self._left < 0:
            raise _TooManyObjects
        return value


class _NumberParser:
    """Number literals as ints and floats, or `_Rejected` for one too long or not finite."""

    def __init__(self, max_digits: int) -> None:
        self._max_digits = max_digits
        self.rejected = False  # whether any number was

    def integer(self, literal: str) -> int | _Rejected:
        if len(literal) > self._max_digits:
            return self._too_long(literal)
        return int(literal)

    def real(self, literal: str) -> float | _Rejected:
        if len(literal) > self._max_digits:
            return self._too_long(literal)
        value = float(literal)
        return value if abs(value) != float("inf") else self.constant(literal)

    def constant(self, literal: str) -> _Rejected:
        """Also NaN, Infinity, -Infinity: Python's JSON extensions, not JSON."""
        self.rejected = True
        return _Rejected(literal)

    def _too_long(self, literal: str) -> _Rejected:
        self.rejected = True
        limit = f"numbers may have at most {self._max_digits} characters (--max-json-number-digits)"
        return _Rejected(f"{literal[:20]}... ({len(literal)} characters)", limit)


_Path = tuple[str | int, ...]


def _check_structure(
    body: dict[str, Any], limits: BodyLimits, strings: bool, numbers: bool
) -> None:
    """Depth, and (when asked) lone surrogates in strings and keys and rejected numbers,
    container by container: no recursion, and a container holding nothing to look at costs one
    C-speed pass over its values."""
    interesting = {dict, list} | ({str} if strings else set()) | ({_Rejected} if numbers else set())
    pending: list[tuple[dict[str, Any] | list[Any], _Path]] = [(body, ())]
    while pending:
        container, path = pending.pop()
        if len(path) >= limits.max_depth:
            raise _too_deep(limits.max_depth, path)
        if isinstance(container, dict):
            if strings and _SURROGATE.search("".join(container)):
                raise _surrogate(path, "a key")
            values: Iterable[Any] = container.values()
            items: Iterable[tuple[str | int, Any]] = container.items()
        else:
            values, items = container, enumerate(container)
        kinds = set(map(type, values))
        if kinds.isdisjoint(interesting):
            continue
        if kinds == {str} and not _SURROGATE.search("".join(values)):
            continue
        for key, value in items:
            if type(value) in (dict, list):
                pending.append((value, (*path, key)))
            elif strings and type(value) is str and _SURROGATE.search(value):
                raise _surrogate((*path, key), "a string")
            elif type(value) is _Rejected:
                message = f"{_where((*path, key))}{value.literal} is not accepted: {value.reason}"
                raise bad_request(message, _param((*path, key)))


def _surrogate(path: _Path, what: str) -> OpenAIError:
    return bad_request(
        f"{_where(path)}{what} holds a lone UTF-16 surrogate (such as \\ud800), which is not "
        "valid Unicode text",
        _param(path),
    )


def _too_deep(limit: int, path: _Path) -> OpenAIError:
    message = (
        f"{_where(path)}the JSON body is nested more than {limit} levels deep (--max-json-depth)"
    )
    return bad_request(message, _param(path))


def _param(path: _Path) -> str | None:
    return ".".join(str(part) for part in path) or None


def _where(path: _Path) -> str:
    return f"{_param(path)}: " if path else ""


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is larger than {limit} bytes (--max-request-bytes)",
        code="request_too_large",
    )
