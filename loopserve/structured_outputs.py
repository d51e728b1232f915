"""What a request's output must match: a JSON schema, any JSON object, a regex, a choice or a
grammar (vLLM's `structured_outputs` / `guided_*` request fields).

Owns: `StructuredOutputsParams`, its validation at the API boundary (exactly one kind of
constraint; the JSON schema is a JSON object; a choice has strings in it) and how it is read
from a request body or a command-line flag (`from_dict`). Must not: import torch or the grammar
backend: whether a schema or grammar compiles is checked by the engine when the request is added
(`structured.grammar`), which says why it does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

# The kinds of constraint, in the order vLLM's `StructuredOutputsParams` lists them.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One constraint on the generated text; the engine masks every token the constraint cannot
    continue with, at whatever loop the token exits.

    `json` is a JSON schema (a dict, or its JSON text; stored as compact JSON text so the
    object stays hashable; key order is kept: the order of `properties` is the order the
    output writes them in). `grammar` is a Lark grammar (or GBNF, as llama.cpp writes it).
    `begin_after` defers the constraint until this token has been generated (a single token of
    the vocabulary, such as `</think>`: the server sets it when a reply opens inside reasoning,
    so the reasoning is free and the answer constrained).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: none or several constraints are given, or one is malformed.
    """

    json: str | dict[str, Any] | None = None  # stored as its compact JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    begin_after: str | None = None

    def __post_init__(self) -> None:
        schema = self.json
        if isinstance(schema, (dict, bool)):
            object.__setattr__(self, "json", _canonical(schema))
        elif isinstance(schema, str):
            object.__setattr__(self, "json", _canonical(_parsed_schema(schema)))
        elif schema is not None:
            raise TypeError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar", "begin_after"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"structured_outputs.{name} must be a string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise TypeError(
                f"structured_outputs.json_object must be a bool, got {self.json_object!r}"
            )
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not all(
                isinstance(item, str) for item in self.choice
            ):
                raise TypeError("structured_outputs.choice must be a list of strings")
            if not self.choice or "" in self.choice:
                raise ValueError("structured_outputs.choice must hold non-empty strings")
        given = self._given()
        if len(given) != 1:
            shown = ", ".join(given) if given else "none"
            raise ValueError(
                f"structured_outputs takes exactly one of {', '.join(KINDS)}; got {shown}"
            )
        if self.begin_after == "":
            raise ValueError("structured_outputs.begin_after must not be empty")

    def _given(self) -> list[str]:
        return [kind for kind in KINDS if getattr(self, kind) not in (None, False)]

    @property
    def kind(self) -> str:
        (kind,) = self._given()
        return kind

    @classmethod
    def from_dict(cls, body: Any) -> StructuredOutputsParams:
        """From a request body's `structured_outputs` object (unknown keys are an error)."""
        if isinstance(body, StructuredOutputsParams):
            return body
        if isinstance(body, str):
            try:
                body = json.loads(body)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise TypeError(f"structured_outputs must be an object, got {body!r}")
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
        return cls(**{key: value for key, value in body.items() if value is not None})

    def schema(self) -> Any:
        """The JSON schema as a Python object (`json` only)."""
        return None if self.json is None else json.loads(str(self.json))


def _parsed_schema(text: str) -> Any:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"structured_outputs.json is not valid JSON: {error}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema object")
    return schema


def _canonical(schema: Any) -> str:
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structured_outputs.json is not JSON-serialisable: {error}") from None
