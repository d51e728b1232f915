"""The ingress's affinity keys: the prefix-cache hash of the prompt the replica will run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the ingress needs the `serve` extra")

from loopserve.config import EngineConfig
from loopserve.entrypoints.openai.config import ServerConfig
from loopserve.models.builtin import BUILTIN_MODEL_DIR
from loopserve.ray.prompt_keys import CHAT_PATH, COMPLETIONS_PATH, PromptKeys
from loopserve.ray.routing import affinity_key
from loopserve.tokenizer import Tokenizer

PAGES = 2
PROMPT = "".join(
    f"def function_{index}(value):\n    return value * {index}\n" for index in range(20)
)


@pytest.fixture(scope="module")
def keys() -> PromptKeys:
    return PromptKeys.load(EngineConfig(model=str(BUILTIN_MODEL_DIR)), ServerConfig(), PAGES)


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_a_text_prompt_keys_by_its_first_full_pages(keys: PromptKeys) -> None:
    tokenizer = Tokenizer.from_directory(BUILTIN_MODEL_DIR)
    assert tokenizer is not None
    expected = affinity_key(tokenizer.encode(PROMPT), 16, PAGES)
    assert expected is not None
    assert keys.key(COMPLETIONS_PATH, _body(prompt=PROMPT)) == expected
    assert keys.key(COMPLETIONS_PATH, _body(prompt=[PROMPT, "x"], n=2)) == expected
    assert keys.key(COMPLETIONS_PATH, _body(prompt=PROMPT + "# a different ending\n")) == expected
    token_ids = list(range(40))
    by_ids = keys.key(COMPLETIONS_PATH, _body(prompt=token_ids))
    assert by_ids == affinity_key(token_ids, 16, PAGES)


def test_chat_keys_by_the_rendered_conversation(keys: PromptKeys) -> None:
    first = keys.key(CHAT_PATH, _body(messages=[{"role": "user", "content": PROMPT}]))
    later = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "ok"}]
    assert first is not None
    assert keys.key(CHAT_PATH, _body(messages=later)) == first


def test_short_or_bad_requests_have_no_key(keys: PromptKeys) -> None:
    assert keys.key(COMPLETIONS_PATH, _body(prompt="import os")) is None
    assert keys.key(COMPLETIONS_PATH, b"{not json") is None
    assert keys.key(COMPLETIONS_PATH, _body(prompt=PROMPT, max_tokens="many")) is None
    assert keys.key(CHAT_PATH, _body(messages="hello")) is None
    assert keys.key(COMPLETIONS_PATH, b"[" * 100_000) is None


def test_zero_pages_give_no_key_so_routing_is_by_load_only() -> None:
    off = PromptKeys.load(EngineConfig(model=str(BUILTIN_MODEL_DIR)), ServerConfig(), 0)
    assert off.key(COMPLETIONS_PATH, _body(prompt=PROMPT)) is None
    assert off.key(COMPLETIONS_PATH, _body(prompt=list(range(200)))) is None
    assert off.key(CHAT_PATH, _body(messages=[{"role": "user", "content": PROMPT}])) is None
