"""Structured outputs on a CUDA GPU, on the built-in model: the fused step with CUDA graphs equals
the serial reference with the same grammars (fp32, gate exits after one loop, so rows wait for
their bitmasks), and constrained steady-state steps add no host synchronisation.

Run on a GPU machine with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.reference import SerialReference
from loopserve.structured_outputs import StructuredOutputsParams as Spec
from tests.e2e.test_structured_outputs import CASES, check_matches, params
from tests.gpu.test_engine_gpu import steps_without_synchronising

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("llguidance", reason="structured outputs need llguidance (carry its wheel)")
# Many items: a request keeps generating for as long as the test steps.
LONG = Spec(
    json={
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "minItems": 200,
    }
)


@pytest.mark.parametrize("kv_layout", ["full", "shared"])
def test_constrained_graphs_equal_the_reference(kv_layout: str) -> None:
    llm = LLM(dtype="float32", device="cuda", kv_layout=kv_layout, num_kv_pages=512)
    assert llm.engine.info.cuda_graphs
    requests = [params(index, spec) for index, (_, spec) in enumerate(CASES)]
    outputs = llm.generate([prompt for prompt, _ in CASES], requests)
    reference = SerialReference(llm.engine.runner.model, kv_layout=kv_layout, exit_mode="ouro")
    assert llm.tokenizer is not None
    for (prompt, spec), request, output in zip(CASES, requests, outputs, strict=True):
        sequence = output.outputs[0]
        grammar = llm.engine.constraints.check(spec) if spec is not None else None
        expected = reference.generate(
            llm.tokenizer.encode(prompt), llm.engine.resolve(request), grammar=grammar
        )
        got = (sequence.token_ids, sequence.exit_depths, sequence.finish_reason)
        assert got == (expected.token_ids, expected.exit_depths, expected.finish_reason)
        if spec is not None and spec.kind != "json_object":
            check_matches(spec, sequence.text)


def test_constrained_steady_state_steps_do_not_synchronise() -> None:
    llm = LLM(device="cuda", num_kv_pages=1024)
    engine = llm.engine
    assert llm.tokenizer is not None
    for index in range(8):
        spec = LONG if index % 2 == 0 else None
        request = SamplingParams(
            max_tokens=300, ignore_eos=True, exit_threshold=0.3, seed=index, structured_outputs=spec
        )
        engine.add_request(llm.tokenizer.encode(f"x{index} = "), request)
    steps_without_synchronising(engine, engine.runner.graphs, 40)  # type: ignore[attr-defined]
    assert engine.stats().num_running == 8
    while engine.has_unfinished_requests():
        engine.step()
