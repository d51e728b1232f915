"""`text_offset` of completion log-probs indexes the choice's `text`: without a tokenizer the text
is empty, so every offset is 0 (the `token_id:N` strings are no part of it), streamed or not; with
one, offsets advance by each token's text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loopserve.entrypoints.openai.logprobs import LogprobFormatter
from loopserve.outputs import TokenLogprobs

from .server_testing import RunningServer, serve_in_thread

BODY = {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 1, "temperature": 0.0}


@pytest.fixture(scope="module")
def tokenless_server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    assert not (tiny_checkpoint / "tokenizer.json").exists()
    with serve_in_thread(tiny_checkpoint) as running:
        yield running


def _post(server: RunningServer, body: dict[str, Any]) -> httpx.Response:
    headers = {**server.headers, "Content-Type": "application/json"}
    url = server.url + "/v1/completions"
    return httpx.post(url, content=json.dumps(body).encode(), headers=headers, timeout=30)


def test_offsets_without_a_tokenizer_are_into_the_empty_text(
    tokenless_server: RunningServer,
) -> None:
    response = _post(tokenless_server, BODY)
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["text"] == ""
    logprobs = choice["logprobs"]
    assert logprobs["tokens"][0].startswith("token_id:")
    assert logprobs["text_offset"] == [0, 0, 0, 0]


def test_streamed_offsets_without_a_tokenizer_are_zero(tokenless_server: RunningServer) -> None:
    response = _post(tokenless_server, {**BODY, "stream": True})
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
    offsets = [
        offset
        for event in events
        for choice in json.loads(event)["choices"]
        if choice.get("logprobs")
        for offset in choice["logprobs"]["text_offset"]
    ]
    assert offsets == [0, 0, 0, 0]


class _Letters:
    """A stand-in tokenizer: token i decodes to i letters."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "x" * token_ids[0]


def test_offsets_with_a_tokenizer_advance_by_each_token_text() -> None:
    entries = [TokenLogprobs(2, -0.5), TokenLogprobs(3, -1.0)]
    logprobs, end = LogprobFormatter(_Letters()).completion(entries, 4)  # type: ignore[arg-type]
    assert (logprobs.text_offset, end) == ([4, 6], 9)
    logprobs, end = LogprobFormatter(None).completion(entries, 4)
    assert (logprobs.text_offset, end) == ([4, 4], 4)
