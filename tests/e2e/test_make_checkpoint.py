"""`loopserve make-checkpoint`: config.json declares the dtype the tensors are written in, every
file gets the same mode, and the result loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loopserve.entrypoints.cli import main
from loopserve.models.loader import load_checkpoint


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_config_says_the_dtype_that_was_written(tmp_path: Path, dtype: str) -> None:
    directory = tmp_path / "ckpt"
    assert main(["make-checkpoint", str(directory), "--dtype", dtype, "--max-shard-mb", "0.1"]) == 0
    assert json.loads((directory / "config.json").read_text())["torch_dtype"] == dtype
    modes = {path.stat().st_mode & 0o777 for path in directory.iterdir()}
    assert len(modes) == 1 and len(list(directory.glob("*.safetensors"))) > 1
    model = load_checkpoint(directory, torch.float32, "cpu")
    assert model.config.weights_dtype == dtype


def test_a_nanbeige_preset_writes_a_nanbeige_checkpoint(tmp_path: Path) -> None:
    from loopserve.models.nanbeige import NanbeigeForCausalLM

    directory = tmp_path / "nanbeige"
    assert main(["make-checkpoint", str(directory), "--preset", "nanbeige-tiny"]) == 0
    raw = json.loads((directory / "config.json").read_text())
    assert (raw["model_type"], raw["architectures"], raw["num_loops"]) == (
        "nanbeige",
        ["NanbeigeForCausalLM"],
        2,
    )
    model = load_checkpoint(directory, torch.float32, "cpu")
    assert isinstance(model, NanbeigeForCausalLM) and model.config.num_key_value_heads == 1
