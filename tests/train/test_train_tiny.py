"""`loopserve train-tiny --small` on the CPU: the loss goes down and the checkpoint works."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loopserve.data.windows import BatchSampler
from loopserve.entrypoints.cli import main
from loopserve.models.loader import load_checkpoint
from loopserve.tokenizer import Tokenizer
from loopserve.train.config import ModelShape, Stage1Config, Stage2Config
from loopserve.train.progress import ProgressLog
from loopserve.train.stage1 import build_model
from loopserve.train.stage2 import train_stage2


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("train-tiny") / "model"
    assert main(["train-tiny", str(output), "--small", "--device", "cpu"]) == 0
    return output


def _progress(directory: Path, stage: str) -> list[dict]:
    info = json.loads((directory / "training_info.json").read_text())
    return [record for record in info["progress"] if record["stage"] == stage]


def test_the_loss_goes_down(small_run: Path) -> None:
    stage1 = _progress(small_run, "stage1")
    assert len(stage1) >= 5
    first = stage1[0]["loss"]  # before the first update: about ln(vocab)
    last = sum(record["loss"] for record in stage1[-2:]) / 2
    assert last < first - 0.75, (first, last)
    held_out = _progress(small_run, "heldout")
    vocab = json.loads((small_run / "config.json").read_text())["vocab_size"]
    assert held_out[-1]["loop_losses"][-1] < math.log(vocab) - 0.75
    assert all(record["tokens_per_s"] > 0 for record in stage1)


def test_the_checkpoint_loads_with_its_tokenizer(small_run: Path) -> None:
    files = sorted(path.name for path in small_run.iterdir())
    assert files == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "training_info.json",
    ]
    model = load_checkpoint(small_run, torch.float32, "cpu")
    tokenizer = Tokenizer.from_directory(small_run)
    assert tokenizer is not None
    assert tokenizer.vocab_size == model.config.vocab_size
    assert tokenizer.token_to_id("<|endoftext|>") == 0 == model.config.bos_token_id
    code = "def area(width, height):\n    return width * height\n"
    ids = tokenizer.encode(code)
    assert tokenizer.decode(ids) == code
    with torch.no_grad():
        logits = model.compute_logits(model.embed(torch.tensor(ids[:4])))
    assert torch.isfinite(logits).all()


def test_same_seed_same_weights(tmp_path: Path) -> None:
    quick = ["--small", "--device", "cpu", "--steps", "3", "--gate-steps", "2", "--max-files", "30"]
    assert main(["train-tiny", str(tmp_path / "a"), *quick]) == 0
    assert main(["train-tiny", str(tmp_path / "b"), *quick]) == 0
    assert main(["train-tiny", str(tmp_path / "c"), *quick, "--seed", "1"]) == 0
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in "abc"]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]


def test_stage2_changes_only_the_gate() -> None:
    shape = ModelShape(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_loops=3,
    )
    model = build_model(shape, Stage1Config(), seed=0)
    before = {name: param.clone() for name, param in model.named_parameters()}
    stream = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(0))
    sampler = BatchSampler(stream, seq_len=16, seed=0)
    train_stage2(model, sampler, Stage2Config(steps=3, batch_size=4), None, ProgressLog(None))
    changed = {
        name for name, param in model.named_parameters() if not torch.equal(param, before[name])
    }
    assert changed == {"model.early_exit_gate.weight", "model.early_exit_gate.bias"}


def test_bad_flags_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert main(["train-tiny", str(tmp_path / "full"), "--small", "--device", "cpu"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert main(["train-tiny", str(tmp_path / "x"), "--small", "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
