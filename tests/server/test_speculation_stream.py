"""A speculating engine behind the server (the built-in model, where proposals are right and a
step often makes several tokens final): a stream carries one event per token, the streamed
text and tokens equal the non-streamed response and decoding without speculation, and
/metrics counts the proposals."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from loopserve.models.builtin import BUILTIN_MODEL_DIR

from .server_testing import RunningServer, serve_in_thread

SPECULATIVE = {"num_speculative_tokens": 4, "draft_loops": 1, "disable_by_batch_size": None}
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef list_python_files(directory):\n"]
BODY = {
    "max_tokens": 40,
    "temperature": 0,
    "extra_body": {"return_token_ids": True, "exit_threshold": 0.5},
}


@pytest.fixture(scope="module")
def speculating() -> Iterator[RunningServer]:
    engine = {"dtype": "float32", "num_kv_pages": 512, "speculative_config": SPECULATIVE}
    with serve_in_thread(BUILTIN_MODEL_DIR, engine=engine) as running:
        yield running


def test_one_event_per_token_and_the_outputs_of_plain_decoding(speculating: RunningServer) -> None:
    import openai

    from loopserve import LLM, SamplingParams

    client: Any = openai.OpenAI(base_url=f"{speculating.url}/v1", api_key="x", max_retries=0)
    plain = LLM(dtype="float32", num_kv_pages=512).generate(
        PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, exit_threshold=0.5)
    )
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        whole = client.completions.create(model="tiny", prompt=prompt, **BODY).choices[0]
        events = [
            choice
            for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True, **BODY)
            for choice in chunk.choices
        ]
        assert [len(event.token_ids) for event in events] == [1] * len(whole.token_ids)
        assert [t for event in events for t in event.token_ids] == whole.token_ids
        assert "".join(event.text for event in events) == whole.text
        assert whole.token_ids == expected.outputs[0].token_ids
        assert whole.text == expected.outputs[0].text
        assert events[-1].finish_reason == whole.finish_reason == "length"
    metrics = speculating.metrics()
    drafted = metrics["loopserve:spec_decode_num_draft_tokens_total"]
    assert drafted > 20
    assert 0 < metrics["loopserve:spec_decode_num_accepted_tokens_total"] < drafted
    assert 0 < metrics["loopserve:spec_decode_num_drafts_total"] < drafted
