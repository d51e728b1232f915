"""Writes random-weight checkpoints of every looped family in the exact HF layout, for tests and
benchmarks.

Owns: config.json, generation_config.json and safetensors files (single or sharded with an index)
for any family's config; config.json declares the dtype the tensors really have, and every file
gets the same permissions (0666 less the umask, as `open` gives). Must not: be used to save trained
models silently over existing files.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from loopserve.kv.storage import FP8
from loopserve.models.loader import (
    EMBEDDING_TENSORS,
    INDEX_FILE,
    SCALE_SUFFIX,
    SINGLE_FILE,
    expected_tensors,
    fp8_weights,
    is_norm_weight,
)
from loopserve.models.model_config import LoopedConfig
from loopserve.models.quant import quantize_weight


@dataclass(frozen=True, slots=True)
class RandomInit:
    """How random weights are drawn. Defaults give decisive logits even in tiny models."""

    # Std of every linear weight as a multiple of 1/sqrt(fan_in).
    weight_scale: float = 1.0
    # Std of the embedding table.
    embedding_std: float = 1.0
    # The exit gate: std of its weight (times 1/sqrt(hidden)) and its bias. A larger std spreads
    # the exit hazards so that gate-driven exits really vary between tokens.
    gate_scale: float = 1.0
    gate_bias: float = 0.0
    # Norm weights are 1 + N(0, norm_jitter).
    norm_jitter: float = 0.1


def random_state_dict(
    config: LoopedConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init: RandomInit | None = None,
) -> dict[str, torch.Tensor]:
    init = init or RandomInit()
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensors(config).items():
        if name == "model.early_exit_gate.bias":
            tensor = torch.full(shape, init.gate_bias)
        elif is_norm_weight(name):
            tensor = 1.0 + init.norm_jitter * torch.randn(shape, generator=generator)
        elif name in EMBEDDING_TENSORS:
            tensor = init.embedding_std * torch.randn(shape, generator=generator)
        else:
            scale = init.gate_scale if "early_exit_gate" in name else init.weight_scale
            std = scale / math.sqrt(shape[-1])
            tensor = std * torch.randn(shape, generator=generator)
        tensors[name] = tensor.to(dtype).contiguous()
    return tensors


def write_checkpoint(
    directory: str | Path,
    config: LoopedConfig,
    tensors: dict[str, torch.Tensor],
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write config, generation config and weights; shard above max_shard_bytes. config.json's
    `torch_dtype` is the tensors' dtype (they must share one); fp8 tensors (`fp8_state_dict`)
    make it an fp8 checkpoint with its `quantization_config`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fp8 = any(tensor.dtype == FP8 for tensor in tensors.values())
    config = replace(
        config,
        weights_dtype=_common_dtype(tensors),
        checkpoint_quantization="fp8" if fp8 else None,
    )
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    metadata = {"format": "pt"}
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        _save(tensors, directory / SINGLE_FILE, metadata)
        return directory
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, directory / file, metadata)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return directory


def fp8_state_dict(
    config: LoopedConfig, tensors: dict[str, torch.Tensor], per_tensor: bool = False
) -> dict[str, torch.Tensor]:
    """`tensors` as an fp8 checkpoint of `config` stores them: each projection as e4m3 beside
    its fp32 `weight_scale`, per output channel ([N]) or, with `per_tensor`, one ([]), as vLLM's
    fp8 checkpoints carry them; the other tensors unchanged."""
    quantized = dict(tensors)
    for name in fp8_weights(replace(config, checkpoint_quantization="fp8")):
        weight = tensors[name]
        if per_tensor:  # the per-row rule over the tensor as one row
            weight8, scale = quantize_weight(weight.reshape(1, -1))
            weight8, scale = weight8.reshape(weight.shape), scale.reshape(())
        else:
            weight8, scale = quantize_weight(weight)
        quantized[name], quantized[name + SCALE_SUFFIX] = weight8, scale.contiguous()
    return quantized


def _common_dtype(tensors: dict[str, torch.Tensor]) -> str:
    """The dtype the tensors share, fp8 weights and their scales apart."""
    dtypes = sorted(
        {
            str(tensor.dtype).removeprefix("torch.")
            for name, tensor in tensors.items()
            if tensor.dtype != FP8 and not name.endswith(SCALE_SUFFIX)
        }
    )
    if len(dtypes) != 1:
        raise ValueError(f"the tensors of one checkpoint must share a dtype, got {dtypes}")
    return dtypes[0]


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors creates its files with mode 0600; give them what every other file gets."""
    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_random_checkpoint(
    directory: str | Path,
    config: LoopedConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    init: RandomInit | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """A random-weight checkpoint in the HF layout that `load_checkpoint` (and HF) can read."""
    tensors = random_state_dict(config, seed=seed, dtype=dtype, init=init)
    return write_checkpoint(directory, config, tensors, max_shard_bytes=max_shard_bytes)
