"""Structured outputs through the engine, on the built-in model (which knows no JSON: only the
constraint can make its output valid): the engine equals the serial reference with the same
grammar, across layouts, scheduling modes, sync and async steps and gate exits after one loop
(the case where a row must wait for its bitmask); outputs match their constraint; bad
constraints are refused before anything is queued (fp32, CPU)."""

from __future__ import annotations

import json
import random
import re
from functools import cache
from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams
from loopserve.reference import SerialReference
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
CASES = [
    ("def fibonacci(n):\n", Spec(json=SCHEMA)),
    ("import os\n", Spec(regex=REGEX)),
    ("class Stack:\n", Spec(choice=CHOICE)),
    ("# Copyright", Spec(grammar=GRAMMAR)),
    ("x = ", None),  # an unconstrained request in the same batch
    ("def f(x):", Spec(json_object=True)),
]
# Low enough that the gate often exits after the first loop, before the bitmask of the token
# sampled in the step before could reach the device (asynchronous scheduling).
THRESHOLD = 0.15


def params(index: int, spec: Spec | None, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if index % 2 else 0.8,
        seed=index,
        exit_threshold=THRESHOLD,
        structured_outputs=spec,
    )


def check_matches(spec: Spec, text: str) -> None:
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


@cache
def builtin(**options: object) -> LLM:
    return LLM(dtype="float32", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kv_layout", "scheduling", "async_scheduling", "num_kv_pages", "block_size"),
    [
        ("full", "refill", True, 512, 16),
        ("shared", "refill", True, 512, 16),
        ("full", "no_refill", True, 512, 16),
        ("shared", "refill", False, 512, 16),
        ("full", "refill", True, 60, 4),  # preemption: requests leave their slots and come back
    ],
)
def test_constrained_engine_equals_reference(
    kv_layout: str, scheduling: str, async_scheduling: bool, num_kv_pages: int, block_size: int
) -> None:
    llm = builtin(
        kv_layout=kv_layout,
        scheduling=scheduling,
        async_scheduling=async_scheduling,
        num_kv_pages=num_kv_pages,
        block_size=block_size,
    )
    requests = [params(index, spec) for index, (_, spec) in enumerate(CASES)]
    outputs = llm.generate([prompt for prompt, _ in CASES], requests)
    reference = SerialReference(llm.engine.runner.model, kv_layout=kv_layout, exit_mode="ouro")
    assert llm.tokenizer is not None
    first_loop_exits = 0
    for (prompt, spec), request, output in zip(CASES, requests, outputs, strict=True):
        sequence = output.outputs[0]
        grammar = llm.engine.constraints.check(spec) if spec is not None else None
        expected = reference.generate(
            llm.tokenizer.encode(prompt), llm.engine.resolve(request), grammar=grammar
        )
        got = (sequence.token_ids, sequence.exit_depths, sequence.finish_reason)
        assert got == (expected.token_ids, expected.exit_depths, expected.finish_reason)
        if spec is not None and spec.kind != "json_object":  # any object may run to the end
            assert sequence.finish_reason == "stop"
            check_matches(spec, sequence.text)
            first_loop_exits += sequence.exit_depths[1:].count(1)
    assert first_loop_exits >= 5, "the gate should exit constrained tokens after one loop"
    if num_kv_pages == 60:
        assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.stats().kv_pages_used == 0


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


def test_one_hundred_random_schemas_yield_valid_json() -> None:
    import jsonschema

    rng = random.Random(31)
    schemas = [random_schema(rng, depth=1 if i % 3 else 0) for i in range(100)]
    llm = builtin(num_kv_pages=2048, max_num_seqs=50)
    requests = [
        params(index, Spec(json=schema), max_tokens=200) for index, schema in enumerate(schemas)
    ]
    outputs = llm.generate(["{"] * len(schemas), requests)
    for schema, output in zip(schemas, outputs, strict=True):
        sequence = output.outputs[0]
        assert sequence.finish_reason == "stop", (schema, sequence.text)
        jsonschema.validate(json.loads(sequence.text), schema)


def test_n_sequences_each_follow_the_constraint() -> None:
    llm = builtin(num_kv_pages=512)
    (output,) = llm.generate("x", params(1, Spec(choice=CHOICE)), n=4)
    assert len(output.outputs) == 4
    assert all(sequence.text in CHOICE for sequence in output.outputs)


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (Spec(regex="(ab"), "structured_outputs.regex"),
        (Spec(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (Spec(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "json"),
        (Spec(choice=("a",), begin_after="two tokens"), "one token"),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_and_queues_nothing(
    spec: Spec, why: str
) -> None:
    llm = builtin(num_kv_pages=512)
    with pytest.raises(ValueError, match=why):
        llm.generate("x", params(0, spec))
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.engine.constraints) == 0


def test_a_model_without_a_tokenizer_refuses_constraints(tiny_checkpoint: Path) -> None:
    llm = LLM(model=str(tiny_checkpoint), num_kv_pages=64)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([1, 2, 3], params(0, Spec(regex="[0-9]")))
    assert not llm.engine.has_unfinished_requests()
