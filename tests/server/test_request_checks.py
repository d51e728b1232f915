"""The checks a request passes before any work, on their own: the JSON body's structural limits,
strict protocol types with the field named, the per-request limits (each named with its flag),
errors that can always be encoded, and `loopserve serve` flags reaching `ServerConfig`."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from loopserve.entrypoints.openai.body import BodyLimits, parse_json_body
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.entrypoints.openai.errors import OpenAIError, error_body
from loopserve.entrypoints.openai.limits import RequestLimits, longest_token_bytes
from loopserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    field_named_in,
    parse_request,
)

LIMITS = BodyLimits(max_depth=8, max_number_digits=20, max_objects=50)


def _body_error(raw: bytes, limits: BodyLimits = LIMITS) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parse_json_body(raw, limits)
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("raw", "param", "words"),
    [
        (b'{"a": {"b": "\\ud800"}}', "a.b", "surrogate"),
        (b'{"a": ["ok", "\\udfff"]}', "a.1", "surrogate"),
        (b'{"\\udc00": 1}', None, "a key"),
        (b'{"seed": ' + b"9" * 5000 + b"}", "seed", "--max-json-number-digits"),
        (b'{"top_p": 0.' + b"1" * 30 + b"}", "top_p", "--max-json-number-digits"),
        (b'{"t": NaN}', "t", "finite"),
        (b'{"t": [1, -Infinity]}', "t.1", "finite"),
        (b'{"t": 1e999}', "t", "finite"),
        (b'{"x": ' + b"[" * 8 + b"]" * 8 + b"}", "x.0.0.0.0.0.0.0", "--max-json-depth"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "--max-json-depth"),
        (b'{"x": [' + b",".join([b"{}"] * 60) + b"]}", None, "--max-json-objects"),
        (b"", None, "empty"),
        (b"[1]", None, "JSON object"),
        (b'{"a": "\xff"}', None, "not valid JSON"),
    ],
)
def test_bad_bodies_are_400_naming_where(raw: bytes, param: str | None, words: str) -> None:
    error = _body_error(raw)
    assert error.param == param and words in error.message, (error.param, error.message)


def test_good_bodies_parse_whatever_they_hold() -> None:
    body = {"a": ["x", 1, 2.5, None, True, {"b": "é🙂"}], "c": "\u2028", "d": 12345678901234567890}
    assert parse_json_body(json.dumps(body).encode(), LIMITS) == body  # escaped surrogate pairs
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode(), LIMITS) == body
    deep = {"x": [[[[[[1]]]]]]}  # depth 7 of at most 8
    assert parse_json_body(json.dumps(deep).encode(), LIMITS) == deep


def test_a_long_bad_list_costs_no_more_than_a_good_one() -> None:
    """Validation stops at the first bad item (pydantic would otherwise report each of them)."""
    for field, bad in [("stop", 1), ("stop_token_ids", "x"), ("prompt", True)]:
        body = {"prompt": "p", field: ["s" if field == "stop" else 1] + [bad] * 200_000}
        start = time.perf_counter()
        with pytest.raises(OpenAIError) as caught:
            parse_request(CompletionRequest, body)
        assert time.perf_counter() - start < 1.0
        assert str(caught.value.param).startswith(field) and caught.value.message.startswith(field)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
        ({"prompt": "x", "n": 2.0}, "n"),
        ({"prompt": "x", "temperature": True}, "temperature"),
        ({"prompt": "x", "temperature": "0.5"}, "temperature"),
        ({"prompt": "x", "stream": 1}, "stream"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "stop": ["a", 1]}, "stop"),
        ({"prompt": [[1, 2], [3, "4"]]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}, "stream": True}, None),
    ],
)
def test_types_are_strict(body: dict[str, Any], param: str | None) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_request(CompletionRequest, body)
    expected = param if param is not None else "stream_options.include_usage"
    assert caught.value.param == expected


def test_union_errors_name_the_field_not_pydantics_member_names() -> None:
    with pytest.raises(OpenAIError) as caught:
        parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert caught.value.param == "messages.0.content"
    assert "accepted forms" in caught.value.message and "list[TextPart]" in caught.value.message
    request = parse_request(CompletionRequest, {"prompt": [[1], []]})
    assert request.prompt == [[1], []]  # an empty prompt is refused later, with its own message


def test_engine_and_sampling_errors_name_their_field() -> None:
    assert field_named_in("top_p must be in (0, 1], got 0.0") == "top_p"
    assert field_named_in("stop[1] must be a string, got 3 (int)") == "stop"
    assert field_named_in("max_loops 9 exceeds the model's loop count (4)") == "max_loops"
    assert field_named_in("the engine failed") is None


def test_error_bodies_escape_lone_surrogates() -> None:
    body = error_body("The model `\ud800` does not exist.", "invalid_request_error", "\udfff")
    encoded = json.dumps(body, ensure_ascii=False).encode("utf-8")  # what a response does
    assert b"\\ud800" in encoded and json.loads(encoded)["error"]["param"] == "\\udfff"


def _limits(**changes: Any) -> RequestLimits:
    config = ServerConfig(**changes)
    return RequestLimits.resolve(config, None, max_model_len=100, max_stop_token_ids=4)


@pytest.mark.parametrize(
    ("check", "param", "flag"),
    [
        (lambda limits: limits.check_choices(3, 50), "n", "--max-choices-per-request"),
        (lambda limits: limits.check_stop(["x"] * 33, set()), "stop", "--max-stop-strings"),
        (lambda limits: limits.check_stop(["é" * 3000], set()), "stop", "--max-stop-bytes"),
        (lambda limits: limits.check_stop([], set(range(5))), "stop_token_ids", "eos"),
        (lambda limits: limits.check_logprobs(21, "top_logprobs"), "top_logprobs", "logprobs"),
        (lambda limits: limits.check_prompt_bytes("é" * 60, "prompt"), "prompt", "prompt-bytes"),
    ],
)
def test_request_limits_name_the_field_and_the_flag(check: Any, param: str, flag: str) -> None:
    limits = _limits()
    with pytest.raises(OpenAIError) as caught:
        check(limits)
    assert caught.value.param == param and flag in caught.value.message


def test_request_limits_follow_the_config() -> None:
    limits = _limits(max_stop_strings=2, max_logprobs=3, max_prompt_bytes=1000)
    limits.check_stop(["a", "b"], set())
    limits.check_logprobs(3, "logprobs")
    limits.check_prompt_bytes("x" * 1000, "prompt")
    for check in (
        lambda: limits.check_stop(["a", "b", "c"], set()),
        lambda: limits.check_logprobs(4, "logprobs"),
        lambda: limits.check_prompt_bytes("x" * 1001, "prompt"),
    ):
        with pytest.raises(OpenAIError):
            check()
    assert _limits().max_prompt_bytes == 100  # no tokenizer: one byte per token of the context


def test_the_prompt_bytes_default_is_the_longest_text_that_can_fit(tiny_model: Any) -> None:
    from loopserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_directory(tiny_model)
    assert tokenizer is not None
    longest = longest_token_bytes(tokenizer)
    assert longest == max(
        len(tokenizer.decode([i], skip_special_tokens=False).encode())
        for i in range(tokenizer.vocab_size)
    )
    text = "The quick brown fox jumps over the lazy dog. " * 50
    num_tokens = len(tokenizer.encode(text))
    assert len(text.encode()) <= num_tokens * longest  # every token covers at most `longest`


@pytest.mark.parametrize(
    "changes",
    [
        {"max_stop_strings": 0},
        {"max_json_depth": 0},
        {"max_logprobs": 21},
        {"max_prompt_bytes": 0},
        {"max_json_number_digits": -1},
    ],
)
def test_server_config_refuses_unusable_limits(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(changes))):
        ServerConfig(**changes)


def test_serve_flags_reach_the_server_config() -> None:
    from loopserve.entrypoints.cli import build_parser
    from loopserve.entrypoints.cli.serve import LIMIT_FLAGS, _server_config

    defaults = _server_config(build_parser().parse_args(["serve"]))
    assert defaults == ServerConfig(served_model_names=("ouro-tiny",))
    argv = ["serve"]
    for number, flag in enumerate(LIMIT_FLAGS, start=2):
        argv += [flag, str(number if flag == "--max-logprobs" else 2000 + number)]
    config = _server_config(build_parser().parse_args(argv))
    for number, (name, _) in enumerate(LIMIT_FLAGS.values(), start=2):
        assert getattr(config, name) in (number, 2000 + number), name


def test_priority_reaches_the_sampling_params_and_must_be_an_integer() -> None:
    from loopserve.entrypoints.openai.prompts import sampling_params

    request = parse_request(CompletionRequest, {"prompt": "x", "priority": -2})
    assert sampling_params(request, 4, None, None).priority == -2
    with pytest.raises(OpenAIError) as caught:
        parse_request(CompletionRequest, {"prompt": "x", "priority": 1.5})
    assert caught.value.status == 400 and caught.value.param == "priority"
