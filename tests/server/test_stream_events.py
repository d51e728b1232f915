"""A stream carries one event per generated token, as vLLM's does: on a checkpoint without a
tokenizer (every text delta empty) and on one with a tokenizer, completions and chat, `n` > 1."""

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
