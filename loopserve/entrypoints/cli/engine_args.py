"""Command-line flags for `EngineConfig`, generated from its fields (and its `SchedulerConfig`'s).

Owns: turning each config field's type, default and help text into one flag, and parsed flags
back into `EngineConfig` options. Must not: restate a default, a choice or a help text: a new
config field gets its flag here without any change to this file.

Field types map to flags: bool -> `--name/--no-name`; an enum -> its values as choices; `int`,
`float`, `str` (optionally `| None`) -> that type; `tuple[float, ...]` -> a comma-separated list;
a dataclass (`SpeculativeConfig`) -> its JSON text.
Values are checked by the configs themselves (their errors name the flag), apart from one rule of
the command line only: `--trace-distribution` gives probabilities, which must sum to 1 (Python
callers may pass weights).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from dataclasses import Field
from typing import Any

from loopserve.config import EngineConfig, SchedulerConfig, config_fields, flag_of
from loopserve.depth.trace import check_distribution

_CONFIGS = (EngineConfig, SchedulerConfig)


def add_engine_arguments(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """One flag per config setting, in a group of its own (`skip`: settings a command sets)."""
    group = parser.add_argument_group("engine (EngineConfig)")
    for config_class in _CONFIGS:
        hints = typing.get_type_hints(config_class)
        for item in config_fields(config_class):
            if item.name not in skip:
                _add_flag(group, item, hints[item.name])


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig.from_options` keyword arguments from parsed flags, all but `model`."""
    options = {
        item.name: getattr(args, item.name)
        for config_class in _CONFIGS
        for item in config_fields(config_class)
        if item.name != "model" and hasattr(args, item.name)
    }
    if options.get("trace_distribution"):  # empty: the family default
        check_distribution(options["trace_distribution"], normalized=True)
    return options


def _add_flag(group: argparse._ArgumentGroup, item: Field[Any], annotation: Any) -> None:
    flag = flag_of(item)
    help_text = item.metadata["help"]
    kind = _base_type(annotation)
    options: dict[str, Any] = {"dest": item.name, "default": item.default}
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        options["choices"] = [member.value for member in kind]
        options["default"] = item.default.value
    elif dataclasses.is_dataclass(kind):  # a nested setting, given as JSON (its config parses it)
        options["type"] = str
        options["metavar"] = "JSON"
    elif kind is tuple:
        options["type"] = _float_list
        options["metavar"] = "P1,P2,..."
        help_text += "; comma-separated"
    else:
        options["type"] = kind
        if item.metadata.get("choices"):
            options["choices"] = list(item.metadata["choices"])
    shown = "" if item.default is None else " (default: %(default)s)"
    group.add_argument(flag, help=help_text + shown, **options)


def _base_type(annotation: Any) -> Any:
    """`int | None` -> int; `tuple[float, ...]` -> tuple; a plain type -> itself."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (kind,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _base_type(kind)
    return typing.get_origin(annotation) or annotation


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
