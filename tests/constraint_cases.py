"""Constraints the structured-output tests share (engine, `LLM` and server): a JSON schema, a
regex, a choice and a Lark grammar with what their text must look like, and random JSON schemas
of nested objects, arrays, enums, bounded numbers and strings that a model always completes."""

from __future__ import annotations

import json
import random
import re

from loopserve.structured_outputs import StructuredOutputsParams as Spec

SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -5, "maximum": 300},
        "b": {"enum": ["x", "yy", 3]},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd)+[0-9]{2}"
CHOICE = ("alpha", "beta")
# Balanced sums of digits: "(2+(1+3))".
GRAMMAR = 'start: expr\nexpr: NUM | "(" expr "+" expr ")"\nNUM: /[0-9]/'
GRAMMAR_TEXT = re.compile(r"[0-9]|\([0-9()+]*\)")


def check_matches(spec: Spec, text: str) -> None:
    """`text` matches `spec`, one of the constraints above."""
    if spec.kind == "json":
        assert json.loads(text).keys() == {"a", "b"}
    elif spec.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec.kind == "regex":
        assert re.fullmatch(REGEX, text)
    elif spec.kind == "choice":
        assert text in CHOICE
    else:
        assert GRAMMAR_TEXT.fullmatch(text) and text.count("(") == text.count("+")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, object]:
    """A JSON schema of nested objects, arrays, enums, bounded numbers and strings."""
    kinds = ["integer", "number", "string", "enum", "boolean"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":  # without multipleOf a model may write fraction digits forever
        low, step = round(rng.uniform(-10, 10), 2), rng.choice([0.5, 0.25])
        return {"type": "number", "minimum": low, "maximum": low + 20, "multipleOf": step}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", 7, None, "a b", True], rng.randint(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        low = rng.randint(0, 2)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + 2}
    names = rng.sample(["id", "name", "size", "tags", "meta", "ok", "when"], rng.randint(1, 3))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
