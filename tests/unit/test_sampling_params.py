"""`SamplingParams` checks types and ranges when it is built: a bool is not an int, integer fields
take integers only, floats must be finite, and every error starts with the field it is about."""

from __future__ import annotations

import math
import types
import typing
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loopserve.sampling_params import MAX_LOGPROBS, SamplingParams

INT_FIELDS = ("max_tokens", "top_k", "min_loops", "seed", "logprobs", "max_loops")
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "exit_threshold")
BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")


def _error(kind: type[Exception], **changes: Any) -> str:
    with pytest.raises(kind) as caught:
        SamplingParams(**changes)
    return str(caught.value)


def test_defaults_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.max_tokens, params.temperature, params.logprobs) == (16, 1.0, None)


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("value", [True, False, 2.5, 3.0, "3"])
def test_integer_fields_take_integers_only(name: str, value: Any) -> None:
    message = _error(TypeError, **{name: value})
    assert message.startswith(f"{name} must be an integer"), message


def test_logprobs_true_is_refused_rather_than_crashing_the_engine() -> None:
    assert "got True (bool)" in _error(TypeError, logprobs=True)
    assert _error(ValueError, logprobs=MAX_LOGPROBS + 1).startswith("logprobs")
    assert SamplingParams(logprobs=0).logprobs == 0


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 10**400])
def test_float_fields_must_be_finite(name: str, value: float) -> None:
    message = _error(ValueError, **{name: value})
    assert message.startswith(f"{name} must be a finite number"), message


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [True, "0.5", [0.5]])
def test_float_fields_refuse_other_types(name: str, value: Any) -> None:
    assert _error(TypeError, **{name: value}).startswith(f"{name} must be a number")


def test_integers_given_for_floats_become_floats() -> None:
    params = SamplingParams(temperature=0, top_p=1, exit_threshold=1)
    assert params.greedy
    assert all(type(getattr(params, name)) is float for name in FLOAT_FIELDS if name != "min_p")


@pytest.mark.parametrize("name", BOOL_FIELDS)
@pytest.mark.parametrize("value", [0, 1, "yes", None])
def test_bool_fields_take_bools_only(name: str, value: Any) -> None:
    assert _error(TypeError, **{name: value}).startswith(f"{name} must be a bool")


def test_stop_strings_and_ids_are_typed() -> None:
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=None, stop_token_ids=None) == SamplingParams()  # vLLM's defaults
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3]).stop_token_ids == (3,)
    assert _error(TypeError, stop=5).startswith("stop must be a list of strings")
    assert _error(TypeError, stop=["a", 3]).startswith("stop[1] must be a string")
    assert _error(TypeError, stop_token_ids=[True]).startswith("stop_token_ids[0] must be an")
    assert _error(TypeError, stop_token_ids="12").startswith("stop_token_ids must be a list")
    assert _error(ValueError, stop_token_ids=[-1]).startswith("stop_token_ids must be in")
    assert _error(ValueError, stop_token_ids=[2**63]).startswith("stop_token_ids must be in")
    assert _error(ValueError, stop=[""]).startswith("stop strings must not be empty")
    assert _error(TypeError, trace_depths=[1.5]).startswith("trace_depths[0] must be an integer")


@pytest.mark.parametrize(
    ("changes", "name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_loops": 0}, "min_loops"),
        ({"min_loops": 3, "max_loops": 2}, "max_loops"),
        ({"exit_threshold": 0.0}, "exit_threshold"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"trace_depths": [0]}, "trace_depths"),
    ],
)
def test_range_errors_start_with_the_field(changes: dict[str, Any], name: str) -> None:
    assert _error(ValueError, **changes).startswith(name)


_HINTS = typing.get_type_hints(SamplingParams)
_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=3),
    st.lists(st.one_of(st.integers(-5, 50), st.text(max_size=2), st.booleans()), max_size=3),
)


def _has_declared_type(value: Any, hint: Any) -> bool:
    optional = isinstance(hint, types.UnionType)
    if value is None:
        return optional
    (kind,) = (
        [arg for arg in typing.get_args(hint) if arg is not type(None)] if optional else [hint]
    )
    if typing.get_origin(kind) is tuple:
        element = typing.get_args(kind)[0]
        return isinstance(value, tuple) and all(_has_declared_type(v, element) for v in value)
    if kind is float:
        return type(value) is float and math.isfinite(value)
    return type(value) is kind


@given(name=st.sampled_from([item.name for item in fields(SamplingParams)]), value=_ANY_VALUE)
def test_any_value_is_stored_with_its_declared_type_or_refused_by_name(
    name: str, value: Any
) -> None:
    try:
        params = SamplingParams(**{name: value})
    except (TypeError, ValueError) as error:
        first_word = str(error).split(" ", 1)[0].split("[", 1)[0]
        assert first_word in (name, "stop", "max_loops"), str(error)
        return
    assert _has_declared_type(getattr(params, name), _HINTS[name]), getattr(params, name)
