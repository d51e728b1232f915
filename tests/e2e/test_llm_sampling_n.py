"""`SamplingParams.n` (vLLM's field): validated at construction and honoured by `LLM.generate` and
`LLM.chat` like the `n=` keyword (sequence i of a seeded request uses seed + i); the keyword and a
params' `n` that disagree are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), num_kv_pages=256, max_num_seqs=8)


def test_n_is_a_sampling_param_checked_when_built() -> None:
    assert SamplingParams().n == 1
    assert SamplingParams(n=4).n == 4
    with pytest.raises(ValueError, match=r"^n must be at least 1"):
        SamplingParams(n=0)
    with pytest.raises(TypeError, match=r"^n must be an integer"):
        SamplingParams(n=2.0)


def test_params_n_gives_the_same_sequences_as_the_keyword(llm: LLM) -> None:
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    by_keyword = llm.generate(PROMPTS, params, n=3)
    by_params = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3))
    for keyword, field in zip(by_keyword, by_params, strict=True):
        assert [s.index for s in field.outputs] == [0, 1, 2]
        assert [s.token_ids for s in field.outputs] == [s.token_ids for s in keyword.outputs]
    # Per-prompt params may ask for different n; agreeing keyword and field are fine.
    mixed = llm.generate(PROMPTS, [SamplingParams(max_tokens=2, n=2), SamplingParams(max_tokens=2)])
    assert [len(output.outputs) for output in mixed] == [2, 1]
    (agreed,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, n=2), n=2)
    assert len(agreed.outputs) == 2


def test_keyword_and_params_n_that_differ_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"n=2 .*SamplingParams\.n is 3"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2, n=3), n=2)
    assert not llm.engine.has_unfinished_requests()


def test_chat_honours_params_n() -> None:
    llm = LLM("ouro-tiny", num_kv_pages=64)
    messages = [{"role": "user", "content": "hi"}]
    (output,) = llm.chat(messages, SamplingParams(max_tokens=3, temperature=0.0, n=2))
    assert [sequence.index for sequence in output.outputs] == [0, 1]


def test_an_engine_request_with_n_above_one_is_refused(llm: LLM) -> None:
    """The engine runs one sequence a request; only LLM fans n out (so n is never dropped)."""
    with pytest.raises(ValueError, match=r"an engine request runs one sequence, got n=2"):
        llm.engine.add_request([5, 6], SamplingParams(max_tokens=2, n=2))
