"""The official `openai` client against the server through real loopback HTTP: completions and
chat, streamed and not, usage, n, seeds, log-probs, echo, stop strings, the Ouro extensions,
and greedy results equal to `LLM.generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loopserve.sampling_params import SamplingParams

from .server_testing import CHAT_TEMPLATE, engine_options

PROMPTS: list[Any] = ["Hello wörld, the quick", "def add(x, y):", [5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def llm(tiny_model: Path):  # type: ignore[no-untyped-def]
    from loopserve.entrypoints.llm import LLM

    return LLM(str(tiny_model), **engine_options())


def _streamed_completion(client: Any, **request: Any) -> tuple[str, list[int], list[int], Any]:
    """(text, token ids, exit depths, usage) gathered from a streamed completion."""
    text, token_ids, depths, usage = "", [], [], None
    finish_reasons = []
    stream = client.completions.create(
        model="tiny", stream=True, stream_options={"include_usage": True}, **request
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            token_ids += choice.token_ids or []
            depths += choice.exit_depths
            finish_reasons.append(choice.finish_reason)
    assert finish_reasons[-1] in ("stop", "length")
    assert all(reason is None for reason in finish_reasons[:-1])
    return text, token_ids, depths, usage


def test_greedy_completions_equal_llm_generate(client: Any, llm: Any) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = llm.generate(PROMPTS, params)
    body = {"max_tokens": 12, "temperature": 0, "extra_body": {"return_token_ids": True}}
    for prompt, request in zip(PROMPTS, expected, strict=True):
        reference = request.outputs[0]
        response = client.completions.create(model="tiny", prompt=prompt, **body)
        choice = response.choices[0]
        assert choice.token_ids == reference.token_ids
        assert choice.text == reference.text
        assert choice.exit_depths == reference.exit_depths
        assert choice.finish_reason == reference.finish_reason
        assert choice.prompt_token_ids == request.prompt_token_ids
        streamed = _streamed_completion(client, prompt=prompt, **body)
        assert streamed[:3] == (reference.text, reference.token_ids, reference.exit_depths)


def test_greedy_chat_equals_llm_generate(client: Any, llm: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = "<|system|>Be brief.\n<|user|>Hi!\n<|assistant|>"
    prompt_ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    reference = llm.generate([prompt_ids], params)[0].outputs[0]
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == reference.text
    assert response.choices[0].exit_depths == reference.exit_depths
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(reference.token_ids)
    assert response.usage.total_tokens == len(prompt_ids) + len(reference.token_ids)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    depths = [depth for chunk in chunks if chunk.choices for depth in chunk.choices[0].exit_depths]
    assert content == reference.text
    assert depths == reference.exit_depths
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(reference.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_usage_counts_match_tokens(client: Any, llm: Any) -> None:
    prompt = "The quick brown fox"
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert response.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
    assert response.usage.completion_tokens == 7 == len(response.choices[0].exit_depths)
    assert response.choices[0].finish_reason == "length"
    _, _, depths, usage = _streamed_completion(
        client, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert usage.completion_tokens == len(depths) == 7
    assert usage.prompt_tokens == response.usage.prompt_tokens


def test_default_max_tokens_is_what_is_left_of_the_context(client: Any) -> None:
    prompt = list(range(1, 250))  # 249 tokens of a 256-token context
    response = client.completions.create(
        model="tiny", prompt=prompt, extra_body={"ignore_eos": True}
    )
    assert response.usage.completion_tokens == 256 - 249
    assert response.choices[0].finish_reason == "length"


def test_prompt_batches_and_n_with_per_choice_seeds(client: Any) -> None:
    body = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    response = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=3, **body)
    assert [choice.index for choice in response.choices] == list(range(6))
    assert response.usage.completion_tokens == 6 * 6
    texts = [choice.text for choice in response.choices]
    for choice in range(3):  # choice i of a request with seed s samples like n=1 with seed s+i
        single = client.completions.create(
            model="tiny", prompt=PROMPTS[1], n=1, **{**body, "seed": 11 + choice}
        )
        assert single.choices[0].text == texts[3 + choice]
    assert len(set(texts[:3])) > 1, "different choices should sample differently"


def test_completion_logprobs_and_echo(client: Any) -> None:
    prompt = "Hello wörld"
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert len(logprobs.text_offset) == len(logprobs.top_logprobs) == 5
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert logprob <= 0.0
        assert top[token] == pytest.approx(logprob)
        assert 1 <= len(top) <= 3
    echoed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed, *_ = _streamed_completion(
        client, prompt=prompt, max_tokens=5, temperature=0, echo=True
    )
    assert streamed == echoed.choices[0].text


def test_chat_logprobs(client: Any) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_strings_cut_the_text_streamed_or_not(client: Any) -> None:
    body = {"prompt": "def add(x, y):", "temperature": 0}
    free = client.completions.create(model="tiny", max_tokens=24, **body).choices[0].text
    stop = free[6:9]
    assert len(stop) == 3
    response = client.completions.create(model="tiny", max_tokens=24, stop=[stop, "never"], **body)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop
    assert choice.text == free[: free.index(stop)]
    streamed, *_ = _streamed_completion(client, max_tokens=24, stop=[stop, "never"], **body)
    assert streamed == choice.text


def test_ouro_loop_depth_extensions(client: Any) -> None:
    prompt = "The quick brown fox"
    fixed = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, extra_body={"max_loops": 2}
    )
    assert fixed.choices[0].exit_depths == [2] * 6
    early = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        extra_body={"min_loops": 2, "exit_threshold": 0.05, "ignore_eos": True},
    )
    depths = early.choices[0].exit_depths
    assert len(depths) == 6 and all(2 <= depth <= 4 for depth in depths)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        extra_body={"max_loops": 3},
    )
    assert chat.choices[0].exit_depths == [3] * len(chat.choices[0].exit_depths)


def test_models_endpoint(client: Any) -> None:
    models = client.models.list().data
    assert [model.id for model in models] == ["tiny"]
    assert models[0].max_model_len == 256
    assert models[0].num_loops == 4
    # what the engine runs: the server fixture's defaults on the CPU (fp32, unquantized)
    assert (models[0].dtype, models[0].kv_cache_dtype, models[0].quantization) == (
        "float32",
        "float32",
        "none",
    )
    assert models[0].kv_cache_scales is None  # K/V not fp8: no scales


def test_chat_template_is_the_checkpoints(tiny_model: Path) -> None:
    import json

    config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
