"""A stream carries one event per generated token, as vLLM's does: on a checkpoint without a
tokenizer (every text delta empty) and on one with a tokenizer, completions and chat, `n` > 1;
the events of one engine output go out in one write; events are ASCII-only JSON, each chunk
written as its whole serialization would be."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from .server_testing import API_KEY, serve_in_thread

NUM_TOKENS = 8


@pytest.fixture(scope="module")
def tokenizerless(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(server url, checkpoint directory) of a checkpoint without a tokenizer."""
    from loopserve.models.checkpoint_writer import write_random_checkpoint
    from loopserve.models.ouro_config import OuroConfig

    directory = tmp_path_factory.mktemp("no-tokenizer")
    config = OuroConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    write_random_checkpoint(directory, config)
    with serve_in_thread(Path(directory)) as running:
        yield running.url, Path(directory)


def _events(url: str, path: str, body: dict[str, Any], api_key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    events = []
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def _per_choice(events: list[dict]) -> dict[int, list[dict]]:
    choices: dict[int, list[dict]] = defaultdict(list)
    for event in events:
        for choice in event["choices"]:
            choices[choice["index"]].append(choice)
    return choices


def test_a_tokenizerless_completion_streams_an_event_per_token(tokenizerless: Any) -> None:
    body = {
        "model": "tiny", "prompt": [5, 6, 7], "max_tokens": NUM_TOKENS, "n": 2, "seed": 3,
        "temperature": 1.0, "stream": True, "return_token_ids": True, "ignore_eos": True,
    }  # fmt: skip
    choices = _per_choice(_events(tokenizerless[0], "/v1/completions", body))
    assert sorted(choices) == [0, 1]
    for events in choices.values():
        assert len(events) == NUM_TOKENS
        assert all(len(event["token_ids"]) == 1 and event["text"] == "" for event in events)
        assert all(len(event["exit_depths"]) == 1 for event in events)
        assert [event["finish_reason"] for event in events] == [None] * 7 + ["length"]


def test_a_chat_stream_carries_an_event_per_token(server: Any) -> None:
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "Héllo wörld"}],
        "max_tokens": NUM_TOKENS, "n": 2, "stream": True, "return_token_ids": True,
        "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    events = _events(server.url, "/v1/chat/completions", body, API_KEY)
    choices = _per_choice(events)
    for events_of_choice in choices.values():
        role, *tokens = events_of_choice  # the first chunk of a choice names the role
        assert role["delta"].get("role") == "assistant"
        assert [len(event["token_ids"]) for event in tokens] == [1] * NUM_TOKENS
        assert tokens[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 2 * NUM_TOKENS


def test_bench_serve_measures_itl_on_a_tokenizerless_checkpoint(
    tokenizerless: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("aiohttp", reason="the serving benchmark client uses aiohttp")
    import argparse

    from loopserve.bench.serve_client import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    url, model_dir = tokenizerless
    args = parser.parse_args([
        "--base-url", url, "--tokenizer", str(model_dir), "--num-prompts", "3",
        "--input-len", "6", "--output-len", str(NUM_TOKENS), "--max-concurrency", "2",
    ])  # fmt: skip
    assert run(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["stream_warning"] is None
    assert summary["total_output_tokens"] == 3 * NUM_TOKENS
    assert 0 < summary["median_itl_ms"] <= summary["p99_itl_ms"]
    assert summary["median_ttft_ms"] < summary["median_e2el_ms"]


def test_bench_serve_refuses_latencies_from_coarse_streams() -> None:
    from loopserve.bench.serve_figures import RequestResult, summarize

    coarse = RequestResult(prompt_len=4, success=True, output_tokens=8, ttft=0.7, latency=0.7)
    coarse.token_events = 1  # the whole completion arrived in one event
    summary = summarize([coarse], 1.0, (50.0, 99.0))
    assert "fewer events than tokens" in summary["stream_warning"]
    assert summary["median_ttft_ms"] is None and summary["median_tpot_ms"] is None
    assert summary["median_itl_ms"] is None and summary["median_e2el_ms"] == pytest.approx(700)


def test_goodput_counts_the_requests_that_meet_every_target() -> None:
    from loopserve.bench.serve_figures import Goodput, RequestResult, summarize

    def result(ttft: float, latency: float) -> RequestResult:
        timed = RequestResult(prompt_len=4, success=True, output_tokens=11, ttft=ttft)
        timed.latency, timed.token_events = latency, 11
        return timed

    # TPOT of each: (latency - ttft) / 10 -> 10 ms, 10 ms, 50 ms
    results = [result(0.1, 0.2), result(0.9, 1.0), result(0.1, 0.6)]
    goodput = Goodput.parse(["ttft:500", "tpot:20"])
    assert goodput.targets_ms == {"ttft": 500.0, "tpot": 20.0}
    assert summarize(results, 2.0, (50.0,), goodput)["request_goodput"] == pytest.approx(0.5)
    assert summarize(results, 2.0, (50.0,))["request_goodput"] is None
    for bad in ("ttft", "itl:5", "tpot:x", "e2el:-1"):
        with pytest.raises(ValueError, match="--goodput"):
            Goodput.parse([bad])


def test_stream_events_are_ascii_only_json(server: Any) -> None:
    """Text with U+2028 and the like is escaped: line readers that split on it see whole events."""
    prompt = "Héllo\u2028wörld\u0085 🙂"
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "echo": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        raw = response.read()
    events = [event for event in raw.split(b"\n\n") if event]
    assert events[-1] == b"data: [DONE]"
    assert all(event.isascii() and event.startswith(b"data: ") for event in events)
    first = json.loads(events[0].removeprefix(b"data: "))
    assert first["choices"][0]["text"] == prompt


def test_chunk_events_are_the_bytes_of_the_whole_chunk() -> None:
    from loopserve.entrypoints.openai.responses import (
        ChatChunkChoice,
        ChatCompletionChunk,
        ChatDelta,
        CompletionChoice,
        CompletionResponse,
    )
    from loopserve.entrypoints.openai.serving import ChunkEvents
    from loopserve.entrypoints.openai.streaming import sse_model_event

    envelopes_and_choices: list[tuple[Any, list[Any]]] = [
        (
            CompletionResponse(id="cmpl-1", created=7, model='a "model"', choices=[]),
            [
                CompletionChoice(index=0, text="é\u2028", exit_depths=[4], token_ids=[9]),
                CompletionChoice(index=1, text="", finish_reason="length", exit_depths=[]),
            ],
        ),
        (
            ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[]),
            [ChatChunkChoice(index=0, delta=ChatDelta(content="🙂"), exit_depths=[2, 3])],
        ),
    ]
    for envelope, choices in envelopes_and_choices:
        whole = envelope.model_copy(update={"choices": choices})
        assert ChunkEvents(envelope).event(choices) == sse_model_event(whole)
        assert ChunkEvents(envelope).event([]) == sse_model_event(envelope)
    with pytest.raises(ValueError, match="empty"):
        ChunkEvents(envelopes_and_choices[0][0].model_copy(update={"choices": choices}))


def test_the_events_of_one_output_go_out_in_one_write() -> None:
    """An output with three new tokens (a speculating engine's) is three events in one send."""
    import asyncio
    from types import SimpleNamespace

    from loopserve.entrypoints.openai.engine_thread import EngineRequest
    from loopserve.entrypoints.openai.prompts import ChoicePlan, Prompt
    from loopserve.entrypoints.openai.protocol import CompletionRequest, parse_request
    from loopserve.entrypoints.openai.serving import ResponseIdentity, respond
    from loopserve.entrypoints.openai.serving_completions import _CompletionWriter
    from loopserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from loopserve.sampling_params import SamplingParams

    sequence = CompletionOutput(
        index=0, text="abc", token_ids=[7, 8, 9], exit_depths=[4, 2, 3], logprobs=None,
        finish_reason="length", new_token_ids=[7, 8, 9], new_text="abc",
    )  # fmt: skip
    output = RequestOutput("cmpl-1-0", None, [1, 2], [sequence], True, RequestMetrics(0.0))

    class OneOutputEngine:
        async def add(self, requests: Any, queue: asyncio.Queue[Any]) -> None:
            queue.put_nowait(output)

        def abort(self, request_ids: Any) -> None:
            pass

    request = parse_request(
        CompletionRequest,
        {"prompt": [1, 2], "max_tokens": 3, "stream": True, "return_token_ids": True},
    )
    prompt = Prompt([1, 2], None)
    plan = ChoicePlan(0, 0, prompt, EngineRequest("cmpl-1-0", prompt.token_ids, SamplingParams()))
    context: Any = SimpleNamespace(logprobs=None)  # the writer reads it for log-probs only
    writer = _CompletionWriter(ResponseIdentity("cmpl-1", 7, "m"), [plan], request, context)
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            sent.append(message["body"])

    async def receive() -> Any:
        await asyncio.Event().wait()  # the client stays

    async def stream() -> None:
        engine: Any = OneOutputEngine()
        client: Any = SimpleNamespace(receive=receive)
        response = await respond(client, engine, [plan], True, writer)
        await response({"type": "http"}, receive, send)

    asyncio.run(stream())
    assert len(sent) == 2 and sent[1] == b"data: [DONE]\n\n"
    events = [json.loads(event.removeprefix(b"data: ")) for event in sent[0].split(b"\n\n")[:-1]]
    choices = [event["choices"][0] for event in events]
    assert [choice["token_ids"] for choice in choices] == [[7], [8], [9]]
    assert [choice["exit_depths"] for choice in choices] == [[4], [2], [3]]
    assert [choice["text"] for choice in choices] == ["", "", "abc"]
    assert [choice["finish_reason"] for choice in choices] == [None, None, "length"]
