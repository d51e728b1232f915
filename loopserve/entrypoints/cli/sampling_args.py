"""Command-line flags for `SamplingParams`, generated from its fields.

Owns: turning each field's type, default and help text into one flag, checking numbers as they
are parsed (integers for integer fields; finite numbers for float fields: `nan` and `inf` are
refused), and parsed flags back into `SamplingParams`, whose own validation then applies. Must
not: restate a default or a help text: `generate --help` shows `SamplingParams()`'s defaults, and a
new field gets its flag here without any change to this file (the approach of `engine_args`).

Field types map to flags: bool -> `--name/--no-name`; `int`, `float` (optionally `| None`) ->
that type; `tuple[str, ...]` -> a repeatable flag; `tuple[int, ...]` -> comma-separated integers;
`StructuredOutputsParams` -> a JSON object (`--structured-outputs '{"regex": "[0-9]+"}'`).
Each flag stores into `sampling_<field>`, apart from the engine's flags (`--engine-seed` is the
engine's `seed`).
"""

from __future__ import annotations

import argparse
import math
import types
import typing
from dataclasses import Field, fields
from typing import Any

from loopserve.sampling_params import SamplingParams
from loopserve.structured_outputs import StructuredOutputsParams

_DEST_PREFIX = "sampling_"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `SamplingParams` field, in a group of its own."""
    group = parser.add_argument_group("sampling (SamplingParams)")
    hints = typing.get_type_hints(SamplingParams)
    for item in fields(SamplingParams):
        _add_flag(group, item, hints[item.name])


def sampling_params(args: argparse.Namespace, base: SamplingParams) -> SamplingParams:
    """`SamplingParams` from parsed flags, `base`'s value for every flag not given (the
    checkpoint's generation_config.json defaults, say); a ValueError saying which flag is wrong."""
    options = {}
    for item in fields(SamplingParams):
        value = getattr(args, _DEST_PREFIX + item.name)
        options[item.name] = getattr(base, item.name) if value is None else value
    try:
        return SamplingParams(**options)
    except (TypeError, ValueError) as error:
        raise ValueError(f"--{_flag_name(str(error))}: {error}") from None


def _flag_name(message: str) -> str:
    """`top_p must be ...` -> `top-p`: the field a SamplingParams error starts with, as a flag."""
    return message.split(" ", 1)[0].split("[", 1)[0].replace("_", "-")


def _add_flag(group: argparse._ArgumentGroup, item: Field[Any], annotation: Any) -> None:
    flag = "--" + item.name.replace("_", "-")
    help_text = item.metadata["help"]
    kind, element = _base_type(annotation)
    # None marks a flag not given: `sampling_params` then takes the base's value.
    options: dict[str, Any] = {"dest": _DEST_PREFIX + item.name, "default": None}
    if kind is not bool:
        options["metavar"] = item.name.upper()
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif kind is tuple and element is str:
        options.update(action="append", metavar="TEXT")
        help_text += "; repeatable"
    elif kind is tuple:
        options.update(type=_int_tuple, metavar="N1,N2,...")
        help_text += "; comma-separated"
    elif kind is StructuredOutputsParams:
        options.update(type=_structured, metavar="JSON")
    else:
        options["type"] = _finite_float if kind is float else int
    shown = "" if item.default in (None, ()) else f" (default: {item.default})"
    group.add_argument(flag, help=help_text + shown, **options)


def _base_type(annotation: Any) -> tuple[Any, Any]:
    """`int | None` -> (int, None); `tuple[str, ...]` -> (tuple, str); a plain type -> itself."""
    if isinstance(annotation, types.UnionType):
        (kind,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _base_type(kind)
    if typing.get_origin(annotation) is tuple:
        return tuple, typing.get_args(annotation)[0]
    return annotation, None


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _int_tuple(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _structured(text: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.from_dict(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
