"""A checkpoint with Nanbeige4.2-3B's published config.json (scaled down) and tensor names starts
with no engine flags, sizes its KV for two loops, chats to `<|im_end|>`, and refuses gate exits
(it has no gate); `loopserve generate` and `loopserve serve` start on it with no sizing flags."""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams
from tests.published_configs import (
    NANBEIGE_4_2_3B_CONFIG,
    SCALED_DOWN_NANBEIGE,
    write_nanbeige_checkpoint,
)
from tests.real_ouro import ANSWER
from tests.served import CLI, environment, serving

IM_END = 2
CHAT = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def nanbeige_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_nanbeige_checkpoint(tmp_path_factory.mktemp("nanbeige-4.2-like"))


@pytest.fixture(scope="module")
def llm(nanbeige_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(nanbeige_dir), kv_cache_memory_gb=0.25)
    yield llm
    del llm


def test_the_checkpoint_is_the_published_config_scaled_down(nanbeige_dir: Path) -> None:
    raw = json.loads((nanbeige_dir / "config.json").read_text())
    assert raw == NANBEIGE_4_2_3B_CONFIG | SCALED_DOWN_NANBEIGE


def test_kv_is_sized_for_two_loops(nanbeige_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        llm = LLM(str(nanbeige_dir), kv_cache_memory_gb=0.25)
    info = llm.engine.info
    assert llm.engine.model_config.family == "nanbeige"
    assert llm.engine.max_model_len == min(4096, (info.num_kv_pages - 1) // 2 * 16)
    assert info.dtype == "bfloat16" or info.dtype == "float32"


def test_chat_ends_at_im_end(llm: LLM) -> None:
    (output,) = llm.chat(CHAT)
    (sequence,) = output.outputs
    assert sequence.token_ids[-1] == IM_END and len(sequence.token_ids) == 2
    assert (sequence.text, sequence.finish_reason) == (ANSWER, "stop")
    assert sequence.exit_depths == [2, 2]
    (thinking,) = llm.chat(CHAT, chat_template_kwargs={"enable_thinking": True})
    assert thinking.prompt is not None and thinking.prompt.endswith("assistant\n<think>\n")


def test_gate_exits_are_refused_and_traces_run(llm: LLM, nanbeige_dir: Path) -> None:
    with pytest.raises(ValueError, match="nanbeige models have no exit rule"):
        llm.generate([[5, 6, 7]], SamplingParams(exit_threshold=0.5))
    traced = LLM(str(nanbeige_dir), kv_cache_memory_gb=0.25, exit_mode="trace")
    (output,) = traced.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True, trace_depths=[1, 2, 1])
    )
    assert output.outputs[0].exit_depths == [2, 1, 2, 1]


@pytest.mark.slow
def test_generate_starts_with_no_sizing_flags(nanbeige_dir: Path) -> None:
    command = [*CLI, "generate", "--model", str(nanbeige_dir), "--prompt", "Hi", "--json"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=environment(), check=False
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["text"], record["finish_reason"]) == (ANSWER, "stop")


@pytest.mark.slow
def test_serve_starts_with_no_sizing_flags(nanbeige_dir: Path) -> None:
    pytest.importorskip("fastapi", reason="serving needs the `serve` extra")
    openai = pytest.importorskip("openai", reason="the chat request goes through the openai client")
    with serving(nanbeige_dir) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        reply = client.chat.completions.create(model=str(nanbeige_dir), messages=CHAT)  # type: ignore[arg-type]
        (choice,) = reply.choices
        assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
