"""`LLM` in vLLM's shape: `RequestOutput.outputs[i]` (`CompletionOutput`), `n` sequences per prompt,
`chat`, the built-in model by name, and generation_config.json's sampling defaults for requests
that give no `SamplingParams`."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from loopserve import LLM, CompletionOutput, RequestOutput, SamplingParams
from loopserve.models.builtin import BUILTIN_MODEL_DIR, BUILTIN_MODEL_NAME
from loopserve.models.model_config import ConfigError

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint: Path) -> LLM:
    return LLM(str(tiny_checkpoint), num_kv_pages=256, max_num_seqs=8)


def _with_generation_config(source: Path, target: Path, generation: dict[str, object]) -> Path:
    shutil.copytree(source, target)
    (target / "generation_config.json").write_text(json.dumps(generation))
    return target


def test_generate_returns_one_request_output_per_prompt_with_its_sequences(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    assert [output.prompt_token_ids for output in outputs] == PROMPTS
    for output in outputs:
        assert isinstance(output, RequestOutput) and output.finished
        (sequence,) = output.outputs
        assert isinstance(sequence, CompletionOutput) and sequence.index == 0
        assert len(sequence.token_ids) == len(sequence.exit_depths) == 4
        assert sequence.logprobs is not None and len(sequence.logprobs) == 4
        assert (sequence.finish_reason, sequence.text) == ("length", "")  # no tokenizer: no text


def test_n_sequences_per_prompt_use_seed_plus_index(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    outputs = llm.generate(PROMPTS, params, n=3)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert [sequence.index for sequence in output.outputs] == [0, 1, 2]
        for index, sequence in enumerate(output.outputs):
            (alone,) = llm.generate(
                [prompt], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + index)
            )
            assert sequence.token_ids == alone.outputs[0].token_ids
        assert len({tuple(sequence.token_ids) for sequence in output.outputs}) > 1
        assert output.metrics.finished_time is not None
    with pytest.raises(ValueError, match="n must be at least 1"):
        llm.generate(PROMPTS, params, n=0)


def test_a_bad_prompt_among_n_sequences_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1: "):
        llm.generate([[1, 2], [10**6]], SamplingParams(max_tokens=2), n=2)
    assert not llm.engine.has_unfinished_requests()


def test_generation_config_defaults_apply_when_no_params_are_given(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    generation = {"temperature": 0.0, "top_k": 3, "top_p": 0.9, "min_p": 0.01, "max_new_tokens": 5}
    directory = _with_generation_config(tiny_checkpoint, tmp_path / "ckpt", generation)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(directory), num_kv_pages=64)
    expected = SamplingParams(temperature=0.0, top_k=3, top_p=0.9, min_p=0.01, max_tokens=5)
    assert llm.get_default_sampling_params() == expected
    assert "sampling defaults from generation_config.json" in caplog.text
    (unset,) = llm.generate([PROMPTS[0]])
    (explicit,) = llm.generate([PROMPTS[0]], expected)
    assert len(unset.outputs[0].token_ids) == 5
    assert unset.outputs[0].token_ids == explicit.outputs[0].token_ids  # greedy, as configured
    off = LLM(str(directory), num_kv_pages=64, generation_config="none")
    assert off.get_default_sampling_params() == SamplingParams()


def test_unimplemented_or_invalid_defaults_are_reported(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    penalised = _with_generation_config(
        tiny_checkpoint, tmp_path / "a", {"repetition_penalty": 1.2}
    )
    with caplog.at_level(logging.WARNING):
        LLM(str(penalised), num_kv_pages=64)
    assert "repetition_penalty 1.2, which loopserve does not implement" in caplog.text
    invalid = _with_generation_config(tiny_checkpoint, tmp_path / "b", {"top_p": 0.0})
    with pytest.raises(ConfigError, match=r"generation_config\.json: top_p"):
        LLM(str(invalid), num_kv_pages=64)


def test_the_builtin_model_is_reachable_by_name_and_chats() -> None:
    llm = LLM(BUILTIN_MODEL_NAME, num_kv_pages=64)
    assert llm.engine.info.model_dir == str(BUILTIN_MODEL_DIR)
    messages = [{"role": "user", "content": "Write a stack."}]
    (output,) = llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0), n=2)
    assert output.prompt == "# user: Write a stack.\n\n"
    assert [len(sequence.token_ids) for sequence in output.outputs] == [4, 4]
    batch = llm.chat([messages, messages], SamplingParams(max_tokens=2, temperature=0.0))
    assert [out.outputs[0].token_ids for out in batch] == [output.outputs[0].token_ids[:2]] * 2


def test_chat_needs_a_tokenizer_and_well_formed_messages(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        llm.chat([{"role": "user", "content": "hi"}])
    builtin = LLM(num_kv_pages=64)
    with pytest.raises(ValueError, match="conversation 0: a message must be a mapping"):
        builtin.chat([{"content": "no role"}])
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        builtin.chat([{"role": "user", "content": "hi"}], chat_template_kwargs={"messages": []})


def test_the_command_line_takes_the_builtin_model_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from loopserve.entrypoints.cli import main

    argv = ["generate", "--model", BUILTIN_MODEL_NAME, "--prompt", "import os", "--max-tokens", "3"]
    assert main([*argv, "--json", "--num-kv-pages", "64"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert len(record["token_ids"]) == 3 and record["text"]


def test_batch_invariant_needs_the_cuda_kernels() -> None:
    with pytest.raises(
        ValueError, match=r"batch_invariant needs a CUDA device.*leave batch_invariant"
    ):
        LLM(num_kv_pages=64, device="cpu", batch_invariant=True)
