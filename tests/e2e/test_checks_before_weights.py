"""What config.json and the checkpoint's files can answer is refused before the weights load: a
max_model_len past max_position_embeddings, a trace distribution with more depths than the
model's loops, and `eval gsm8k` on a checkpoint without tokenizer.json (same messages as before,
only sooner)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loopserve import LLM
from loopserve.entrypoints.cli import main
from loopserve.tokenizer import has_tokenizer

FIXTURE = Path(__file__).parents[1] / "eval" / "fixtures" / "gsm8k_small.jsonl"


@pytest.fixture
def no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading weights fails the test: the check under test must come first."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the weights were loaded before the check")

    monkeypatch.setattr("loopserve.runner.setup.load_checkpoint", refuse)


@pytest.mark.usefixtures("no_weights")
def test_max_model_len_past_the_model_is_refused_before_the_weights(
    tiny_checkpoint: Path,
) -> None:
    with pytest.raises(
        ValueError, match=r"^max_model_len \(--max-model-len\) 4096 exceeds the model's "
    ):
        LLM(str(tiny_checkpoint), max_model_len=4096, num_kv_pages=64)


@pytest.mark.usefixtures("no_weights")
def test_an_exit_criterion_of_another_family_is_refused_by_its_flag(
    tiny_checkpoint: Path,
) -> None:
    with pytest.raises(ValueError, match=r"^exit_criterion \(--exit-criterion\) 'kl' is not one"):
        LLM(str(tiny_checkpoint), exit_criterion="kl")


@pytest.mark.usefixtures("no_weights")
def test_a_trace_with_more_depths_than_loops_is_refused_before_the_weights(
    tiny_checkpoint: Path,
) -> None:
    with pytest.raises(ValueError, match=r"gives 5 depths but the model runs at most 4 loops"):
        LLM(str(tiny_checkpoint), exit_mode="trace", trace_distribution=(1, 1, 1, 1, 1))


@pytest.mark.usefixtures("no_weights")
def test_gsm8k_without_a_tokenizer_is_refused_before_the_weights(
    tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not has_tokenizer(tiny_checkpoint)
    argv = ["eval", "gsm8k", str(FIXTURE), "--model", str(tiny_checkpoint), "--limit", "1"]
    assert main(argv) == 2
    assert "has no tokenizer.json; gsm8k needs one" in capsys.readouterr().err


def test_has_tokenizer_looks_for_the_file(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from loopserve.models.builtin import BUILTIN_MODEL_DIR

    assert has_tokenizer(BUILTIN_MODEL_DIR)
    copy = shutil.copytree(tiny_checkpoint, tmp_path / "model")
    (copy / "tokenizer.json").mkdir()  # not a file
    assert not has_tokenizer(copy)
