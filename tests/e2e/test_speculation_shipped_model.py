"""Self-speculative decoding on the built-in trained model, where most proposals are right: every
output (tokens, exit depths, log-probs, text, finish reason) equals decoding without
speculation, greedy and sampled, with gate exits and at fixed depth, with rounds cut by stop
strings, stop token ids and `max_tokens`; and the engine really speculated."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest

from loopserve import LLM, SamplingParams
from loopserve.outputs import CompletionOutput

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(directory):\n",
    "class Stack:\n    def push(self, item):\n",
    "# Copyright",
    "for i in range(",
    "x = [",
]
# (K, d). With d = 1 and gate exits at 0.5, about a quarter of the steps that give a request
# tokens give it several (a later token exits in fewer loops than the one before it).
SPECULATIVE = (4, 2)
SEVERAL_PER_STEP = (4, 1)


@cache
def engine(speculative: tuple[int, int] | None, scheduling: str = "refill") -> LLM:
    options: dict[str, object] = {}
    if speculative is not None:
        k, d = speculative
        options["speculative_config"] = {
            "num_speculative_tokens": k,
            "draft_loops": d,
            "disable_by_batch_size": None,
        }
    return LLM(dtype="float32", num_kv_pages=512, max_num_seqs=8, scheduling=scheduling, **options)


def generate(llm: LLM, params: list[SamplingParams]) -> list[CompletionOutput]:
    return [output.outputs[0] for output in llm.generate(PROMPTS, params, use_tqdm=False)]


def summary(output: CompletionOutput) -> tuple[object, ...]:
    logprobs = None
    if output.logprobs is not None:
        logprobs = [(step.token_id, [i for i, _ in step.top]) for step in output.logprobs]
    return (
        output.token_ids,
        output.exit_depths,
        output.text,
        output.finish_reason,
        output.stop_reason,
        logprobs,
    )


def assert_same(speculated: list[CompletionOutput], plain: list[CompletionOutput]) -> None:
    """Everything equal, log-probs to 1e-4 (the batch a row runs in may move fp32 logits in
    their last bits)."""
    assert [summary(o) for o in speculated] == [summary(o) for o in plain]
    for mine, theirs in zip(speculated, plain, strict=True):
        for step, expected in zip(mine.logprobs or [], theirs.logprobs or [], strict=True):
            values = [step.logprob] + [p for _, p in step.top]
            wanted = [expected.logprob] + [p for _, p in expected.top]
            assert values == pytest.approx(wanted, abs=1e-4)


def params_for(threshold: float, temperature: float, **extra: object) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=12 + 3 * index,
            temperature=temperature,
            top_p=0.9 if index % 3 == 0 else 1.0,
            seed=index,
            exit_threshold=threshold,
            logprobs=2 if index % 2 else None,
            **extra,  # type: ignore[arg-type]
        )
        for index in range(len(PROMPTS))
    ]


@pytest.mark.parametrize("speculative", [SPECULATIVE, SEVERAL_PER_STEP])
@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize(("threshold", "temperature"), [(1.0, 0.0), (0.5, 0.0), (0.5, 0.8)])
def test_speculation_changes_no_output(
    threshold: float, temperature: float, scheduling: str, speculative: tuple[int, int]
) -> None:
    params = params_for(threshold, temperature)
    plain = generate(engine(None, scheduling), params)
    llm = engine(speculative, scheduling)
    before = llm.engine.stats()
    speculated = generate(llm, params)
    assert_same(speculated, plain)
    after = llm.engine.stats()
    proposed = after.proposed_tokens - before.proposed_tokens
    confirmed = after.confirmed_tokens - before.confirmed_tokens
    # Trained weights: most proposals are right, and not all.
    assert proposed > 40 and 0.3 * proposed < confirmed < proposed, (proposed, confirmed)
    # Every step speculates, so every token but each request's first (the prompt's) is made
    # final by one; chains of confirmed proposals are what speculation gains.
    made = after.speculative_tokens - before.speculative_tokens
    assert made == after.generated_tokens - before.generated_tokens - len(PROMPTS)
    drafts = after.speculative_drafts - before.speculative_drafts
    assert drafts == made - confirmed > 0
    assert after.mean_accepted_length > 1.5


def test_many_seeds_sample_what_decoding_without_speculation_samples() -> None:
    """Per seed, not only in distribution: a proposal is kept only when it is the token the
    final decision samples with the same noise."""
    params = [
        SamplingParams(max_tokens=6, temperature=1.0, seed=seed, exit_threshold=0.5)
        for seed in range(48)
    ]
    prompts = [PROMPTS[seed % len(PROMPTS)] for seed in range(48)]
    plain = engine(None).generate(prompts, params, use_tqdm=False)
    speculated = engine(SPECULATIVE).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in speculated] == [o.outputs[0].token_ids for o in plain]
    assert len({tuple(o.outputs[0].token_ids) for o in plain}) > 24  # they really vary


def test_rounds_cut_by_stop_strings_stop_ids_and_max_tokens() -> None:
    base = generate(engine(None), params_for(0.5, 0.0))
    cuts = []
    for index, output in enumerate(base):
        stop = output.text[len(output.text) // 2 :][:3]
        stop_id = output.token_ids[3 + index % 4]
        cuts.append(
            SamplingParams(
                max_tokens=1 + index,
                temperature=0.0,
                exit_threshold=0.5,
                stop=[stop] if index % 2 == 0 and stop.strip() else [],
                stop_token_ids=[stop_id] if index % 3 == 1 else [],
            )
        )
        cuts.append(
            SamplingParams(
                max_tokens=40,
                temperature=0.0,
                exit_threshold=0.5,
                stop=[stop] if stop.strip() else [],
                stop_token_ids=[stop_id] if index % 2 else [],
            )
        )
    prompts = [prompt for prompt in PROMPTS for _ in range(2)]
    plain = engine(None).generate(prompts, cuts, use_tqdm=False)
    speculated = engine(SEVERAL_PER_STEP).generate(prompts, cuts, use_tqdm=False)
    assert_same([o.outputs[0] for o in speculated], [o.outputs[0] for o in plain])
    reasons = {o.outputs[0].finish_reason for o in plain}
    assert reasons == {"stop", "length"}, reasons
    assert engine(SEVERAL_PER_STEP).engine.stats().kv_pages_used == 0


def test_a_stop_string_inside_a_step_drops_the_tokens_after_it() -> None:
    """A step that makes several tokens final and a stop string that ends at one of its first
    tokens: the later ones are dropped, as decoding token by token never makes them."""
    llm = engine(SEVERAL_PER_STEP)
    assert llm.tokenizer is not None
    params = SamplingParams(max_tokens=40, temperature=0.0, exit_threshold=0.5)
    groups: dict[str, list[list[int]]] = {}
    for index, prompt in enumerate(PROMPTS):
        llm.engine.add_request(prompt, params, request_id=str(index))
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            groups.setdefault(output.request_id, []).append(output.outputs[0].new_token_ids)
    stops: list[SamplingParams] = []
    for index in range(len(PROMPTS)):
        tokens = [token for group in groups[str(index)] for token in group]
        ends = [sum(map(len, groups[str(index)][: g + 1])) for g in range(len(groups[str(index)]))]
        several = [
            end - len(group)
            for end, group in zip(ends, groups[str(index)], strict=True)
            if len(group) > 1
        ]
        text = llm.tokenizer.decode(tokens)
        stop = None
        for first in several:  # the first token of a group of several
            head = llm.tokenizer.decode(tokens[: first + 1])
            candidate = head[-4:]
            if candidate.strip() and text.find(candidate) == len(head) - len(candidate):
                stop = candidate
                break
        stops.append(dataclasses.replace(params, stop=[stop] if stop else []))
    assert sum(bool(p.stop) for p in stops) >= 3, "too few stop strings inside a step"
    plain = engine(None).generate(PROMPTS, stops, use_tqdm=False)
    speculated = llm.generate(PROMPTS, stops, use_tqdm=False)
    assert_same([o.outputs[0] for o in speculated], [o.outputs[0] for o in plain])
    assert sum(o.outputs[0].finish_reason == "stop" for o in plain) >= 3
