"""Issue 12's acceptance: a checkpoint with Ouro-1.4B's exact config.json keys and values, its
tensor names, Ouro's special tokens and a ChatML template (`tests/real_ouro.py`) starts with no
engine flags, and a chat answer ends at `<|im_end|>` with finish_reason "stop" although every eos
field says id 0."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loopserve import LLM, SamplingParams
from loopserve.runner.setup import auto_dtype
from tests.real_ouro import ANSWER, OURO_1_4B_CONFIG, SCALED_DOWN, write_ouro_like_checkpoint
from tests.served import CLI, environment, serving

IM_END = 2
CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ouro_like_checkpoint(tmp_path_factory.mktemp("ouro-1.4b-like"))


@pytest.fixture(scope="module")
def llm(ouro_dir: Path) -> Iterator[LLM]:
    """The checkpoint with a small CPU KV budget (fast to allocate); every other setting default."""
    llm = LLM(str(ouro_dir), kv_cache_memory_gb=0.25)
    yield llm
    del llm


def test_the_checkpoint_is_ouro_1_4b_but_for_the_scaled_sizes(ouro_dir: Path) -> None:
    raw = json.loads((ouro_dir / "config.json").read_text())
    assert raw == OURO_1_4B_CONFIG | SCALED_DOWN
    assert (raw["eos_token_id"], raw["max_position_embeddings"]) == (0, 65536)
    assert json.loads((ouro_dir / "generation_config.json").read_text())["eos_token_id"] == 0


def test_max_model_len_defaults_to_what_the_kv_cache_holds(
    ouro_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(str(ouro_dir), kv_cache_memory_gb=0.25)
    info = llm.engine.info
    per_request_pages = (info.num_kv_pages - 1) // 4  # 4 planes (loops) of the full layout
    assert llm.engine.max_model_len == per_request_pages * 16 < 65536
    assert f"max_model_len {llm.engine.max_model_len} (the model allows 65536)" in caplog.text
    assert info.dtype == auto_dtype(torch.device("cpu"), "bfloat16")


def test_an_explicit_max_model_len_that_cannot_fit_says_what_to_change(ouro_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"lower --max-model-len .* raise --kv-cache-memory-gb"):
        LLM(str(ouro_dir), kv_cache_memory_gb=0.25, max_model_len=65536)


def test_the_stop_set_holds_eos_and_the_end_of_turn_token(llm: LLM) -> None:
    assert llm.engine.eos_token_ids == {0, IM_END}
    assert "<|im_end|> ends chat turns" in llm.engine.end_of_sequence.describe()


def test_chat_stops_at_im_end_with_no_max_tokens_or_stop_ids(llm: LLM) -> None:
    (output,) = llm.chat(CHAT)
    (sequence,) = output.outputs
    assert output.prompt is not None and output.prompt.endswith("<|im_start|>assistant\n")
    assert sequence.token_ids[-1] == IM_END and len(sequence.token_ids) == 2
    assert (sequence.text, sequence.finish_reason) == (ANSWER, "stop")


def test_ignore_eos_and_stop_token_ids_still_work(llm: LLM) -> None:
    (ignored,) = llm.chat(CHAT, SamplingParams(max_tokens=4, ignore_eos=True))
    assert ignored.outputs[0].token_ids[1] == IM_END and len(ignored.outputs[0].token_ids) == 4
    assert ignored.outputs[0].finish_reason == "length"
    assert llm.tokenizer is not None
    answer = llm.tokenizer.token_to_id(ANSWER)
    (stopped,) = llm.chat(CHAT, SamplingParams(stop_token_ids=[answer]))
    assert stopped.outputs[0].token_ids == [answer]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", answer)


def test_chat_template_kwargs_reach_the_template(llm: LLM) -> None:
    (thinking,) = llm.chat(CHAT, chat_template_kwargs={"enable_thinking": True})
    assert thinking.prompt is not None and thinking.prompt.endswith("assistant\n<think>\n")


@pytest.mark.slow
def test_generate_starts_with_no_engine_flags(ouro_dir: Path) -> None:
    command = [*CLI, "generate", "--model", str(ouro_dir), "--prompt", "Hi", "--json"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=environment(), check=False
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["text"], record["finish_reason"]) == (ANSWER, "stop")
    chosen = re.search(r"max_model_len (\d+) \(the model allows 65536\)", result.stderr)
    assert chosen is not None, result.stderr  # the one line that says what was chosen and why
    assert 16 <= int(chosen.group(1)) < 65536


@pytest.mark.slow
def test_serve_starts_with_no_engine_flags_and_chat_ends_at_im_end(ouro_dir: Path) -> None:
    pytest.importorskip("fastapi", reason="serving needs the `serve` extra")
    openai = pytest.importorskip("openai", reason="the chat request goes through the openai client")
    with serving(ouro_dir) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        (card,) = client.models.list().data
        assert 16 <= card.model_extra["max_model_len"] < 65536
        reply = client.chat.completions.create(model=str(ouro_dir), messages=CHAT)  # type: ignore[arg-type]
        (choice,) = reply.choices
        assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
        assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_chat_splits_reasoning_as_the_server_does(llm: LLM) -> None:
    thinking = {"enable_thinking": True}
    (inside,) = llm.chat(CHAT, chat_template_kwargs=thinking)
    sequence = inside.outputs[0]
    assert (sequence.text, sequence.reasoning_content, sequence.content) == (ANSWER, ANSWER, "")
    (plain,) = llm.chat(CHAT)
    assert (plain.outputs[0].reasoning_content, plain.outputs[0].content) == (None, ANSWER)
    (off,) = llm.chat(CHAT, chat_template_kwargs=thinking, reasoning_parser="none")
    assert (off.outputs[0].reasoning_content, off.outputs[0].content) == (None, None)
    with pytest.raises(ValueError, match=r"must be one of auto, deepseek_r1, none"):
        llm.chat(CHAT, reasoning_parser="qwen9")
