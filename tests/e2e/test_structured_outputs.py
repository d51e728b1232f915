"""Structured outputs through the engine, on the built-in model (which knows no JSON: only the
constraint can make its output valid): the engine equals the serial reference with the same
grammar, across layouts, scheduling modes, sync and async steps and gate exits after one loop
(the case where a row must wait for its bitmask); outputs match their constraint; bad
constraints are refused before anything is queued (fp32, CPU)."""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams
from loopserve.reference import SerialReference
from loopserve.structured_outputs import StructuredOutputsParams as Spec
from tests.constraint_cases import CHOICE, GRAMMAR, REGEX, SCHEMA, check_matches, random_schema
from tests.pressure import PREEMPTING

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


@cache
def builtin(**options: object) -> LLM:
    return LLM(dtype="float32", **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kv_layout", "scheduling", "async_scheduling", "num_kv_pages", "block_size", "preemption"),
    [
        ("full", "refill", True, 512, 16, "swap"),
        ("shared", "refill", True, 512, 16, "swap"),
        ("full", "no_refill", True, 512, 16, "swap"),
        ("shared", "refill", False, 512, 16, "swap"),
        # preemption: requests leave their slots and come back, their K/V swapped or recomputed
        ("full", "refill", True, 60, 4, "swap"),
        ("full", "refill", True, 60, 4, "recompute"),
    ],
)
def test_constrained_engine_equals_reference(
    kv_layout: str,
    scheduling: str,
    async_scheduling: bool,
    num_kv_pages: int,
    block_size: int,
    preemption: str,
) -> None:
    llm = builtin(
        kv_layout=kv_layout,
        scheduling=scheduling,
        async_scheduling=async_scheduling,
        num_kv_pages=num_kv_pages,
        block_size=block_size,
        preemption_mode=preemption,
        **PREEMPTING,
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
        assert (llm.engine.stats().recomputed_tokens > 0) == (preemption == "recompute")
    assert llm.engine.stats().kv_pages_used == 0


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
