"""Per-request generation settings: sampling, stopping, logprobs and loop depth.

Owns: `SamplingParams` and its validation at the API boundary (types and ranges, checked when it
is built: a bool is not an int, integer fields take integers only, floats must be finite), one
help text per setting (the command line's sampling flags are generated from them),
`ResolvedParams` (the same with the engine's defaults filled in) and `SamplingInfo` (what the coda
needs to sample one token). Must not: import torch, or hold values resolved by the engine (the
model's loop count, eos ids, a drawn seed) in `SamplingParams`: those live in `ResolvedParams`,
built once per request by the engine.

Errors raised at construction start with the name of the field they are about (`top_p must be
...`), so a caller can tell its user which setting to fix.
"""

from __future__ import annotations

import math
import reprlib
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any

from loopserve.structured_outputs import StructuredOutputsParams

# Most log-probability alternatives a request may ask for.
MAX_LOGPROBS = 20
# Seeds and stop token ids are stored as signed 64-bit integers.
INT64_LIMIT = 2**63


def _setting(default: Any, help: str) -> Any:
    """A field with its help text (the `generate` command line shows it)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates. Defaults follow vLLM: temperature 1, 16 tokens.

    Raises:
        TypeError: a field has the wrong type (a bool or 2.5 for an integer, a number for a string).
        ValueError: a field is out of range, or a float is NaN or infinite.
    """

    n: int = _setting(
        1, "sequences to generate per prompt (sequence i of a seeded request uses seed + i)"
    )
    max_tokens: int = _setting(16, "maximum number of generated tokens")
    temperature: float = _setting(
        1.0, "0 is greedy; otherwise logits are divided by it before sampling"
    )
    top_p: float = _setting(
        1.0, "nucleus sampling: keep the smallest set of tokens whose probability reaches top_p"
    )
    top_k: int = _setting(0, "keep the top_k most likely tokens; 0 or -1 keeps all")
    min_p: float = _setting(
        0.0, "drop tokens whose probability is below min_p times the most likely one"
    )
    seed: int | None = _setting(
        None,
        "seed of this request's sampling noise (the same seed gives the same tokens whatever the "
        "batch); default: drawn from the engine's seeded generator",
    )
    ignore_eos: bool = _setting(False, "keep generating after an end-of-sequence token")
    stop_token_ids: tuple[int, ...] = _setting(
        (), "extra token ids that end generation (the token is kept in the output)"
    )
    stop: tuple[str, ...] = _setting((), "strings that end generation (cut from the text)")
    logprobs: int | None = _setting(
        None,
        f"return the log-probability of each sampled token and this many alternatives "
        f"(0..{MAX_LOGPROBS}); default: none",
    )
    skip_special_tokens: bool = _setting(True, "decode the text without special tokens")
    # Loop depth: each generated token runs at least min_loops and at most max_loops loops.
    min_loops: int = _setting(1, "each generated token runs at least this many loops")
    max_loops: int | None = _setting(
        None, "each generated token runs at most this many loops; default: the model's loop count"
    )
    exit_threshold: float | None = _setting(
        None,
        "exit once the gate's CDF reaches this (< 1 lets the exit gate stop early, 1.0 = fixed "
        "depth); default: the checkpoint's",
    )
    trace_depths: tuple[int, ...] | None = _setting(
        None,
        "`trace` exit mode: the exit depth of each generated token after the first (the first "
        "always runs max_loops; missing entries run max_loops)",
    )
    structured_outputs: StructuredOutputsParams | None = _setting(
        None,
        "constrain the output: a JSON object with one of json (a schema), regex, choice (a list), "
        "grammar (Lark or GBNF) or json_object (true); default: free text",
    )
    priority: int = _setting(
        0,
        "scheduling priority: lower goes first (arrival order within a priority), and a request "
        "is preempted only for one that ranks higher",
    )

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so the object stays hashable and immutable.
        for name in ("stop_token_ids", "stop", "trace_depths"):
            object.__setattr__(self, name, _as_tuple(name, getattr(self, name)))
        for item in fields(self):
            value = _checked(item.name, getattr(self, item.name), _HINTS[item.name])
            object.__setattr__(self, item.name, value)
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _validate(self) -> None:
        problems = []
        if self.n < 1:
            problems.append(f"n must be at least 1, got {self.n}")
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            problems.append(f"top_k must be -1, 0 (all) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            problems.append(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.min_loops < 1:
            problems.append(f"min_loops must be at least 1, got {self.min_loops}")
        if self.max_loops is not None and self.max_loops < self.min_loops:
            problems.append(f"max_loops ({self.max_loops}) must be >= min_loops ({self.min_loops})")
        if self.exit_threshold is not None and not 0.0 < self.exit_threshold <= 1.0:
            problems.append(f"exit_threshold must be in (0, 1], got {self.exit_threshold}")
        if self.trace_depths is not None and any(depth < 1 for depth in self.trace_depths):
            problems.append("trace_depths must all be at least 1")
        if any(not 0 <= token < INT64_LIMIT for token in self.stop_token_ids):
            problems.append("stop_token_ids must be in [0, 2**63)")
        if any(not text for text in self.stop):
            problems.append("stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < INT64_LIMIT:
            problems.append(f"seed must be in [0, 2**63), got {self.seed}")
        if problems:
            raise ValueError("; ".join(problems))


_HINTS = typing.get_type_hints(SamplingParams)


def _as_tuple(name: str, value: Any) -> Any:
    """A list (or one string, for `stop`) as a tuple, None as none (vLLM's default for `stop`
    and `stop_token_ids`); anything else is left for the type check."""
    if value is None and name in ("stop", "stop_token_ids"):
        return ()
    if name == "stop" and isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _checked(name: str, value: Any, hint: Any) -> Any:
    """`value` if it has the field's type (ints given for a float become floats); else raises."""
    optional = isinstance(hint, types.UnionType) and type(None) in typing.get_args(hint)
    if optional:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if value is None:
            return None
    if hint is StructuredOutputsParams:
        return StructuredOutputsParams.from_dict(value)
    if typing.get_origin(hint) is tuple:
        element = typing.get_args(hint)[0]
        if not isinstance(value, tuple):
            expected = f"a list of {_KIND_NAMES[element]}s" + (" or None" if optional else "")
            raise TypeError(f"{name} must be {expected}, got {reprlib.repr(value)}")
        return tuple(
            _checked_scalar(f"{name}[{i}]", v, element, False) for i, v in enumerate(value)
        )
    return _checked_scalar(name, value, hint, optional)


_KIND_NAMES = {int: "integer", float: "number", bool: "bool", str: "string"}


def _checked_scalar(name: str, value: Any, kind: type, optional: bool) -> Any:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    matches = is_int if kind is int else isinstance(value, kind)
    if kind is float and is_int:
        matches, value = True, float(value) if abs(value) < 2**1000 else math.inf
    if not matches:
        expected = ("an " if kind is int else "a ") + _KIND_NAMES[kind]
        expected += " or None" if optional else ""
        shown = f"{reprlib.repr(value)} ({type(value).__name__})"
        raise TypeError(f"{name} must be {expected}, got {shown}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class ResolvedParams:
    """A request's settings with every engine default filled in (never written back)."""

    params: SamplingParams
    seed: int
    min_loops: int
    max_loops: int
    exit_threshold: float
    eos_token_ids: frozenset[int]  # the model's end-of-sequence ids; empty with ignore_eos

    @property
    def fixed_depth(self) -> bool:
        return self.exit_threshold >= 1.0

    def trace_depth(self, decode_index: int) -> int | None:
        """Given depth of the decode_index-th decode computation (0-based), if traced."""
        depths = self.params.trace_depths
        if depths is None or decode_index >= len(depths):
            return None
        return depths[decode_index]


@dataclass(frozen=True, slots=True)
class SamplingInfo:
    """What the coda needs to sample a request's next token, batch-independently."""

    params: SamplingParams
    seed: int
    output_index: int  # index of the token being sampled among the request's outputs
