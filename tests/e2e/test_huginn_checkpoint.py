"""A checkpoint with Huginn-0125's published config.json (scaled down: its 2-4-2 stage split and 32
loops kept) and tensor names starts with no engine flags, sizes its KV for eight layers over 32
planes, runs every token 32 loops by default and fewer under the convergence rule, draws its
initial states from the request's seed (the same seed, the same tokens, alone or in a batch);
`loopserve generate` and `loopserve serve` start on it with no sizing flags."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loopserve import LLM, SamplingParams
from tests.published_configs import HUGINN_0125_CONFIG, SCALED_DOWN_HUGINN, write_huginn_checkpoint
from tests.served import CLI, environment, serving

PROMPTS = [[5, 6, 7, 8], [40, 41], list(range(100, 120))]


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_huginn_checkpoint(tmp_path_factory.mktemp("huginn-0125-like"))


@pytest.fixture(scope="module")
def llm(huginn_dir: Path) -> Iterator[LLM]:
    llm = LLM(str(huginn_dir))
    yield llm
    del llm


def test_the_checkpoint_is_the_published_config_scaled_down(huginn_dir: Path) -> None:
    raw = json.loads((huginn_dir / "config.json").read_text())
    assert raw == HUGINN_0125_CONFIG | SCALED_DOWN_HUGINN


def test_kv_pages_hold_every_layer_and_the_model_length_fits(llm: LLM) -> None:
    info = llm.engine.info
    config = llm.engine.model_config
    assert (config.family, config.num_loops, config.num_stage_layers) == ("huginn", 32, 4)
    element = 2 if info.dtype == "bfloat16" else 4
    assert info.kv_bytes_per_page == 2 * 8 * 16 * 4 * 16 * element  # 2 + 4 + 2 layers
    assert llm.engine.max_model_len == 4096


def test_fixed_depth_by_default_and_convergence_exits_when_asked(llm: LLM) -> None:
    fixed = llm.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True, seed=7))
    assert all(set(out.outputs[0].exit_depths) == {32} for out in fixed)
    converged = llm.generate(
        PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True, seed=7, exit_threshold=0.3)
    )
    depths = [d for out in converged for d in out.outputs[0].exit_depths[1:]]
    assert max(depths) <= 32 and min(depths) < 32, depths


def test_a_seeded_request_is_the_same_alone_and_in_a_batch(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=11, exit_threshold=0.3)
    batch = llm.generate(PROMPTS, params)
    for prompt, together in zip(PROMPTS, batch, strict=True):
        (alone,) = llm.generate([prompt], params)
        assert alone.outputs[0].token_ids == together.outputs[0].token_ids
        assert alone.outputs[0].exit_depths == together.outputs[0].exit_depths


@pytest.mark.slow
def test_generate_starts_with_no_sizing_flags(huginn_dir: Path) -> None:
    command = [*CLI, "generate", "--model", str(huginn_dir), "--prompt", "Hi", "--json"]
    command += ["--max-tokens", "4"]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=environment(), check=False
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["exit_depths"] == [32] * len(record["token_ids"])


@pytest.mark.slow
def test_serve_starts_with_no_sizing_flags(huginn_dir: Path) -> None:
    pytest.importorskip("fastapi", reason="serving needs the `serve` extra")
    openai = pytest.importorskip("openai", reason="the chat request goes through the openai client")
    with serving(huginn_dir) as base_url:
        client = openai.OpenAI(base_url=base_url, api_key="unused")
        chat = [{"role": "user", "content": "Say hello."}]
        reply = client.chat.completions.create(model=str(huginn_dir), messages=chat, max_tokens=3)  # type: ignore[arg-type]
        (choice,) = reply.choices
        assert choice.finish_reason in ("stop", "length")
