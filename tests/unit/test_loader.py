from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopserve.models.checkpoint_writer import random_state_dict, write_checkpoint
from loopserve.models.loader import CheckpointError, load_checkpoint
from loopserve.models.model_config import ConfigError
from tests.conftest import TINY_CONFIG


def written(tmp_path: Path, **kwargs: object) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = random_state_dict(TINY_CONFIG, seed=3, dtype=torch.bfloat16)
    return write_checkpoint(tmp_path, TINY_CONFIG, tensors, **kwargs), tensors  # type: ignore[arg-type]


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_checkpoint_loads_back_bit_exactly(tmp_path: Path, max_shard_bytes: int | None) -> None:
    directory, tensors = written(tmp_path, max_shard_bytes=max_shard_bytes)
    sharded = (directory / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_bytes is not None)
    model = load_checkpoint(directory, torch.bfloat16, "cpu")
    params = dict(model.named_parameters())
    assert params.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(params[name], tensor), name


def test_dtype_conversion(tmp_path: Path) -> None:
    directory, tensors = written(tmp_path)
    model = load_checkpoint(directory, torch.float32, "cpu")
    weight = model.model.embed_tokens.weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, tensors["model.embed_tokens.weight"].float())


def rewrite(directory: Path, change) -> None:  # type: ignore[no-untyped-def]
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    directory, _ = written(tmp_path)
    rewrite(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj"
    ):
        load_checkpoint(directory, torch.float32, "cpu")


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    directory, _ = written(tmp_path)

    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"] = torch.ones(63)

    rewrite(directory, shrink)
    with pytest.raises(CheckpointError, match=r"model.norm.weight .* shape \[63\].*\[64\]"):
        load_checkpoint(directory, torch.float32, "cpu")


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    directory, _ = written(tmp_path)

    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    rewrite(directory, add)
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*q_norm"):
        load_checkpoint(directory, torch.float32, "cpu")


def test_integer_weights_are_rejected(tmp_path: Path) -> None:
    directory, _ = written(tmp_path)

    def integer(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int32)

    rewrite(directory, integer)
    with pytest.raises(CheckpointError, match="dtype I32"):
        load_checkpoint(directory, torch.float32, "cpu")


def test_missing_shard_and_missing_weights(tmp_path: Path) -> None:
    directory, _ = written(tmp_path, max_shard_bytes=40_000)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (directory / first).unlink()
    with pytest.raises(CheckpointError, match=f"shard {re.escape(first)}"):
        load_checkpoint(directory, torch.float32, "cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(TINY_CONFIG.to_hf_dict()))
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_checkpoint(empty, torch.float32, "cpu")


def test_unsupported_config_fails_before_weights(tmp_path: Path) -> None:
    directory, _ = written(tmp_path)
    raw = json.loads((directory / "config.json").read_text())
    raw["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (directory / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="rope_scaling"):
        load_checkpoint(directory, torch.float32, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_config_declares_the_dtype_the_tensors_have(tmp_path: Path, dtype: torch.dtype) -> None:
    tensors = random_state_dict(TINY_CONFIG, seed=3, dtype=dtype)
    directory = write_checkpoint(tmp_path, TINY_CONFIG, tensors)
    declared = json.loads((directory / "config.json").read_text())["torch_dtype"]
    assert declared == str(dtype).removeprefix("torch.")
    assert load_checkpoint(directory, torch.float32, "cpu").config.weights_dtype == declared


def test_a_config_that_misstates_the_weights_dtype_is_refused(tmp_path: Path) -> None:
    directory, _ = written(tmp_path)  # bf16 tensors
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"torch_dtype": "float32"}))
    with pytest.raises(CheckpointError, match=r"is BF16, but config.json declares .*'float32'"):
        load_checkpoint(directory, torch.float32, "cpu")


@pytest.mark.parametrize("max_shard_bytes", [None, 40_000])
def test_every_file_gets_the_same_permissions(tmp_path: Path, max_shard_bytes: int | None) -> None:
    directory, _ = written(tmp_path, max_shard_bytes=max_shard_bytes)
    modes = {path.name: path.stat().st_mode & 0o777 for path in directory.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert len(set(modes.values())) == 1, modes
