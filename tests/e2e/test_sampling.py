"""Seeded sampling is independent of batch composition; logprobs and filters behave."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams
from loopserve.reference import SerialReference

OTHER_PROMPTS = [[9, 8, 7, 6], list(range(40, 75)), [1], [200, 100, 50, 25, 12]]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), num_kv_pages=256, max_num_seqs=8)


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=seed, exit_threshold=0.6
    )


def test_same_seed_same_tokens_alone_or_in_a_batch(llm: LLM) -> None:
    prompt = [5, 6, 7, 8, 9]
    alone = llm.generate([prompt], sampled(1234))[0].outputs[0]
    others = [
        SamplingParams(max_tokens=9, temperature=0.8, seed=s) for s in range(len(OTHER_PROMPTS))
    ]
    batch = llm.generate(
        [*OTHER_PROMPTS[:2], prompt, *OTHER_PROMPTS[2:]], [*others[:2], sampled(1234), *others[2:]]
    )
    assert batch[2].outputs[0].token_ids == alone.token_ids
    assert batch[2].outputs[0].exit_depths == alone.exit_depths
    reference = SerialReference(llm.engine.runner.model).generate(
        prompt, llm.engine.resolve(sampled(1234))
    )
    assert reference.token_ids == alone.token_ids


def test_different_seeds_differ(llm: LLM) -> None:
    outputs = llm.generate([[5, 6, 7, 8, 9]] * 4, [sampled(seed) for seed in range(4)])
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) > 1


def test_greedy_ignores_the_seed(llm: LLM) -> None:
    outputs = llm.generate(
        [[5, 6, 7]] * 2, [SamplingParams(max_tokens=8, temperature=0.0, seed=s) for s in (1, 2)]
    )
    assert outputs[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_top_k_1_is_greedy(llm: LLM) -> None:
    greedy = llm.generate([[4, 4, 4]], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    top1 = llm.generate(
        [[4, 4, 4]], SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=3)
    )[0].outputs[0]
    assert top1.token_ids == greedy.token_ids


def test_logprobs_of_sampled_token_and_alternatives(llm: LLM) -> None:
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))[
        0
    ].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry.token_id == token and entry.logprob <= 0.0
        assert len(entry.top) == 3
        assert entry.top[0][0] == token  # greedy: the sampled token is the most likely
        assert entry.top[0][1] == pytest.approx(entry.logprob)
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
    reference = SerialReference(llm.engine.runner.model).generate(
        [1, 2, 3], llm.engine.resolve(SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))
    )
    for mine, theirs in zip(out.logprobs, reference.logprobs, strict=True):
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
    no_logprobs = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[
        0
    ].outputs[0]
    assert no_logprobs.logprobs is None


def test_stop_token_ids_and_length(llm: LLM) -> None:
    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop_at = free.token_ids[2]
    stopped = llm.generate(
        [[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[stop_at])
    )[0].outputs[0]
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
