"""A catalogue of malformed requests for every endpoint of `loopserve serve`: wrong types,
out-of-range values, non-finite numbers, lone surrogates and invalid UTF-8, oversize and deeply
nested bodies, huge `n` / stop / logprobs, unsupported and unknown fields, wrong methods, paths and
keys. Each case says what its error must name (in `param` or the message) and, where it is fixed,
its status; `send` sends one and `problem` judges the answer."""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass, field
from typing import Any

import httpx

from .server_testing import API_KEY

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_REQUEST_BYTES = 256 * 1024  # the --max-request-bytes of the server under test
MAX_JSON_DEPTH = 32  # its --max-json-depth (the default)
VALID_COMPLETION: dict[str, Any] = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
VALID_CHAT: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 2,
}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    content: bytes | None  # the raw body (None: no body)
    names: str | None  # what `param` or the message must name (None: a route-level error)
    status: int | None = 400  # None: any 4xx
    method: str = "POST"
    authorized: bool = True
    headers: dict[str, str] = field(default_factory=dict)


def _endpoint(path: str) -> str:
    return "chat" if path == CHAT else "completions"


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


def _field_case(path: str, name: str, value: Any, names: str, status: int | None = 400) -> Case:
    base = VALID_COMPLETION if path == COMPLETIONS else VALID_CHAT
    label = f"{_endpoint(path)}:{name}={reprlib.repr(value)}"
    return Case(label, path, _json({**base, name: value}), names, status)


_WRONG_TYPES: dict[str, tuple[Any, ...]] = {
    "int": (True, 2.5, "3", [1], {"a": 1}),
    "float": (True, "0.5", [0.5]),
    "bool": (1, "true"),
    "str": (5, ["tiny"]),
}
_SHARED_FIELDS = {
    "max_tokens": "int", "top_k": "int", "seed": "int", "n": "int", "min_loops": "int",
    "max_loops": "int", "temperature": "float", "top_p": "float", "min_p": "float",
    "exit_threshold": "float", "stream": "bool", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "return_token_ids": "bool", "model": "str",
}  # fmt: skip
_OUT_OF_RANGE: list[tuple[str, Any]] = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 10**6), ("temperature", -1.0),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2.0), ("seed", -1),
    ("seed", 2**63), ("n", 0), ("n", 10**6), ("min_loops", 0), ("min_loops", 9),
    ("max_loops", 0), ("max_loops", 99), ("exit_threshold", 0.0), ("exit_threshold", 1.5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**64]), ("stop_token_ids", [True]),
    ("stop_token_ids", list(range(100))), ("stop", [""]), ("stop", 5), ("stop", ["a", 3]),
    ("stop", ["x"] * 10_000), ("stop", ["y" * 5000]), ("stream_options", {"include_usage": 1}),
]  # fmt: skip


def _typed_field_cases(path: str) -> list[Case]:
    cases = []
    for name, kind in _SHARED_FIELDS.items():
        for value in _WRONG_TYPES[kind]:
            cases.append(_field_case(path, name, value, name))
    for name, value in _OUT_OF_RANGE:
        cases.append(_field_case(path, name, value, name))
    return cases


def _completion_cases() -> list[Case]:
    values: list[tuple[str, Any, str]] = [
        ("prompt", 5, "prompt"), ("prompt", True, "prompt"), ("prompt", {}, "prompt"),
        ("prompt", [], "prompt"), ("prompt", "", "prompt"), ("prompt", [1, "two"], "prompt"),
        ("prompt", [[1], ["a"]], "prompt"), ("prompt", [True, 1], "prompt"),
        ("prompt", [10**12], "prompt"), ("prompt", [-1], "prompt"),
        ("prompt", list(range(1, 300)), "prompt"), ("prompt", ["ok"] * 200, "n"),
        ("prompt", "word " * 40_000, "prompt"), ("prompt", "\ud800", "prompt"),
        ("prompt", ["ok", "\udfff"], "prompt"), ("echo", 1, "echo"),
        ("logprobs", True, "logprobs"), ("logprobs", 2.5, "logprobs"), ("logprobs", -1, "logprobs"),
        ("logprobs", 21, "logprobs"), ("logprobs", 10**9, "logprobs"), ("best_of", 3, "best_of"),
        ("suffix", "tail", "suffix"), ("presence_penalty", 0.5, "presence_penalty"),
        ("frequency_penalty", True, "frequency_penalty"), ("logit_bias", {"1": 5}, "logit_bias"),
        ("structured_outputs", {"regex": "(ab"}, "structured_outputs"),
        ("structured_outputs", {"regex": "a", "choice": ["b"]}, "structured_outputs"),
        ("structured_outputs", {"grammar": "start: ("}, "structured_outputs"),
        ("structured_outputs", {"json": {"type": "object"}, "bogus": 1}, "structured_outputs"),
        ("structured_outputs", {"json": {"type": "nonsense"}}, "structured_outputs"),
        ("structured_outputs", "[0-9]+", "structured_outputs"),
        ("guided_json", "{bad", "guided_json"), ("guided_choice", [], "guided_choice"),
        ("guided_regex", "[z-a]", "guided_regex"),
        ("guided_grammar", "root ::= (", "guided_grammar"),
        ("model", "\ud83d", "model"), ("model", "gpt-9", "model"),
    ]  # fmt: skip
    cases = [_field_case(COMPLETIONS, name, value, names) for name, value, names in values]
    cases[-1] = _field_case(COMPLETIONS, "model", "gpt-9", "model", status=404)
    many_stops = {**VALID_COMPLETION, "n": 128, "stop": [f"s{i}" for i in range(10_000)]}
    cases.append(
        Case("completions:n=128 with 10000 stop strings", COMPLETIONS, _json(many_stops), "stop")
    )
    echo_out_of_range = {"prompt": [2**40, 5], "echo": True, "max_tokens": 2}
    cases.append(
        Case("completions:echo out-of-range ids", COMPLETIONS, _json(echo_out_of_range), "prompt")
    )
    both = {**VALID_COMPLETION, "echo": True, "logprobs": 1}
    cases.append(Case("completions:echo with logprobs", COMPLETIONS, _json(both), "logprobs"))
    two = {**VALID_COMPLETION, "guided_regex": "a", "structured_outputs": {"choice": ["b"]}}
    cases.append(Case("completions:two constraints", COMPLETIONS, _json(two), "guided_regex"))
    return cases


def _chat_cases() -> list[Case]:
    def message(**fields: Any) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Hi", **fields}]

    values: list[tuple[str, Any, str]] = [
        ("messages", [], "messages"), ("messages", {}, "messages"), ("messages", [1], "messages"),
        ("messages", [{"content": "x"}], "messages.0.role"),
        ("messages", message(role=5), "messages.0.role"),
        ("messages", message(content=5), "messages.0.content"),
        ("messages", message(content=[{"type": "image", "text": "x"}]), "messages.0.content"),
        ("messages", message(content=[{"type": "text", "text": 1}]), "messages.0.content"),
        ("messages", message(content="\ud800"), "messages.0.content"),
        ("messages", message(name="\udbff"), "messages.0.name"),
        ("messages", message(content="word " * 40_000), "messages"),
        ("messages", [{"role": "u"}] * 12_000, "objects"),
        ("logprobs", "yes", "logprobs"), ("top_logprobs", 21, "top_logprobs"),
        ("top_logprobs", True, "top_logprobs"),
        ("add_generation_prompt", 1, "add_generation_prompt"),
        ("max_completion_tokens", 0, "max_completion_tokens"),
        ("max_completion_tokens", True, "max_completion_tokens"), ("tools", [{}], "tools"),
        ("response_format", {"type": "xml"}, "response_format"),
        ("response_format", {"type": "json_schema"}, "response_format"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": []}},
         "response_format"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {}, "strict": 1}},
         "response_format"),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
         "response_format"),
        ("response_format", "text", "response_format"),
        ("structured_outputs", {"choice": []}, "structured_outputs"),
        ("guided_regex", "(", "guided_regex"), ("tool_choice", "required", "tool_choice"),
        ("tool_choice", "sometimes", "tool_choice"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}, "tool_choice"),
    ]  # fmt: skip
    cases = [_field_case(CHAT, name, value, names) for name, value, names in values]
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    two = {**VALID_CHAT, "response_format": schema, "guided_choice": ["a"]}
    cases.append(Case("chat:two constraints", CHAT, _json(two), "guided_choice"))
    orphan = {**VALID_CHAT, "top_logprobs": 2}
    cases.append(Case("chat:top_logprobs without logprobs", CHAT, _json(orphan), "top_logprobs"))
    return cases


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _raw_body_cases(path: str) -> list[Case]:
    """Bodies that are not a valid JSON object, or break a structural limit."""
    endpoint = _endpoint(path)
    valid = VALID_COMPLETION if path == COMPLETIONS else VALID_CHAT
    head = json.dumps(valid)[:-1]  # the valid object without its closing brace
    bodies: list[tuple[str, bytes, str | None, int | None]] = [
        ("empty body", b"", "body", 400),
        ("truncated JSON", head.encode(), "JSON", 400),
        ("array body", b"[1, 2, 3]", "object", 400),
        ("string body", b'"prompt"', "object", 400),
        ("null body", b"null", "object", 400),
        ("invalid UTF-8", b'{"prompt": "\xff\xfe\xfd"}', "JSON", 400),
        ("latin-1 bytes", head.encode() + b', "user": "caf\xe9"}', "JSON", 400),
        ("NaN", (head + ', "temperature": NaN}').encode(), "temperature", 400),
        ("Infinity", (head + ', "top_p": Infinity}').encode(), "top_p", 400),
        ("-Infinity", (head + ', "min_p": -Infinity}').encode(), "min_p", 400),
        ("1e999", (head + ', "temperature": 1e999}').encode(), "temperature", 400),
        ("5000-digit integer", (head + ', "seed": ' + "9" * 5000 + "}").encode(), "seed", 400),
        ("100-digit float", (head + ', "top_p": 0.' + "1" * 100 + "}").encode(), "top_p", 400),
        ("5000-digit unknown field", (head + ', "x": ' + "1" * 5000 + "}").encode(), "x", 400),
        ("depth 40", (head + f', "logit_bias": {_nested(40)}}}').encode(), "depth", 400),
        ("depth 100000", (head + f', "x": {_nested(100_000)}}}').encode(), "depth", 400),
        ("12000 objects", (head + ', "x": [' + ",".join(["{}"] * 12_000) + "]}").encode(),
         "objects", 400),
        ("surrogate key", (head + ', "\\ud800": 1}').encode(), "surrogate", 400),
        ("surrogate in unknown field", (head + ', "user": "\\udc00"}').encode(), "user", 400),
        ("oversize body", _json({**valid, "x": "y" * MAX_REQUEST_BYTES}), "max-request-bytes", 413),
    ]  # fmt: skip
    return [
        Case(f"{endpoint}:{label}", path, content, names, status)
        for label, content, names, status in bodies
    ]


def _route_cases() -> list[Case]:
    """Wrong methods, paths and keys on every endpoint."""
    cases = []
    for path in (COMPLETIONS, CHAT, "/v1/models", "/metrics"):
        body = _json(VALID_COMPLETION if path == COMPLETIONS else VALID_CHAT)
        cases.append(Case(f"no key {path}", path, body, "Authorization", 401, authorized=False))
        wrong = {"Authorization": "Bearer wrong"}
        cases.append(Case(f"wrong key {path}", path, body, "Authorization", 401, headers=wrong))
    for method, path in [("GET", COMPLETIONS), ("PUT", CHAT), ("POST", "/v1/models"),
                         ("DELETE", "/health"), ("POST", "/metrics")]:  # fmt: skip
        cases.append(Case(f"{method} {path}", path, None, None, 405, method=method))
    cases.append(Case("unknown path", "/v1/nothing", b"{}", None, 404))
    cases.append(Case("unknown path GET", "/v1/embeddings", None, None, 404, method="GET"))
    return cases


def bad_requests() -> list[Case]:
    """Every malformed request of the matrix."""
    return [
        *_typed_field_cases(COMPLETIONS),
        *_typed_field_cases(CHAT),
        *_completion_cases(),
        *_chat_cases(),
        *_raw_body_cases(COMPLETIONS),
        *_raw_body_cases(CHAT),
        *_route_cases(),
    ]


def unknown_field_requests() -> list[Case]:
    """Well-formed but for unknown fields, which are ignored (as in vLLM and OpenAI): 200."""
    extra = {"unknown_field": [1, {"a": None}], "user": "someone", "metadata": {"k": "v"}}
    completion, chat = _json({**VALID_COMPLETION, **extra}), _json({**VALID_CHAT, **extra})
    return [
        Case("completions:unknown fields", COMPLETIONS, completion, None, 200),
        Case("chat:unknown fields", CHAT, chat, None, 200),
    ]


def send(http: httpx.Client, case: Case) -> httpx.Response:
    headers = {"Content-Type": "application/json", **case.headers}
    if case.authorized and "Authorization" not in headers:
        headers["Authorization"] = f"Bearer {API_KEY}"
    return http.request(case.method, case.path, content=case.content, headers=headers)


def problem(case: Case, response: httpx.Response) -> str | None:
    """What is wrong with the answer to `case`, or None."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if case.status is not None and response.status_code != case.status:
        return f"status {response.status_code}, expected {case.status}: {response.text[:300]}"
    if response.status_code < 400:
        return None if case.status == 200 else f"accepted: {response.text[:200]}"
    error = response.json().get("error")
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"not the OpenAI error shape: {response.text[:300]}"
    if case.names is not None and case.names not in f"{error['param']} {error['message']}":
        return f"the error does not name {case.names!r}: {error}"
    return None
