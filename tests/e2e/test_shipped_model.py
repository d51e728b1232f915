"""The built-in trained model: engine == serial reference with gate-driven exits (fp32, CPU)."""

from __future__ import annotations

import pytest

from loopserve import LLM, SamplingParams
from loopserve.reference import SerialReference

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(directory):\n",
    "class Stack:\n    def push(self, item):\n",
    "# Copyright",
]


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("kv_layout", ["full", "shared"])
def test_engine_equals_reference_on_the_builtin_model(kv_layout: str, scheduling: str) -> None:
    llm = LLM(dtype="float32", kv_layout=kv_layout, scheduling=scheduling, num_kv_pages=512)
    params = [
        SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i, exit_threshold=0.5)
        for i in range(len(PROMPTS))
    ]
    outputs = [output.outputs[0] for output in llm.generate(PROMPTS, params)]
    reference = SerialReference(llm.engine.runner.model, kv_layout=kv_layout, exit_mode="ouro")
    assert llm.tokenizer is not None
    depths = []
    for prompt, request_params, output in zip(PROMPTS, params, outputs, strict=True):
        expected = reference.generate(
            llm.tokenizer.encode(prompt), llm.engine.resolve(request_params)
        )
        assert (output.token_ids, output.exit_depths) == (expected.token_ids, expected.exit_depths)
        depths += output.exit_depths[1:]
    assert len(set(depths)) >= 2, "the gate should pick different depths for different tokens"
