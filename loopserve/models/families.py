"""The looped families loopserve serves, found from a checkpoint's config.json.

Owns: which `model_type` is which family's config class, reading any checkpoint's config.json as
its family's config, and the named shapes that `loopserve make-checkpoint`, the benchmarks and the
tests write. Must not: import torch (the model classes are the loader's business).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loopserve.models.huginn_config import HuginnConfig
from loopserve.models.model_config import ConfigError, LoopedConfig, parse_config_file
from loopserve.models.nanbeige_config import NanbeigeConfig
from loopserve.models.ouro_config import OuroConfig

# model_type -> the family's config class.
FAMILIES: dict[str, type[LoopedConfig]] = {
    "ouro": OuroConfig,
    "nanbeige": NanbeigeConfig,
    "huginn_raven": HuginnConfig,
}


def config_from_dict(raw: dict[str, Any]) -> LoopedConfig:
    """The config of the family that `raw["model_type"]` names."""
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES[model_type].from_dict(raw)
    served = ", ".join(repr(name) for name in FAMILIES)
    raise ConfigError(
        f"model_type is {model_type!r}; loopserve runs the looped families {served} only"
    )


def read_model_config(path: str | Path) -> LoopedConfig:
    """A checkpoint's config.json as its family's config; errors name the file."""
    return parse_config_file(path, config_from_dict)


# Named shapes: preset -> (family, config.json fields changed from that family's defaults).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "ouro-1.4b": ("ouro", {}),
    "ouro-2.6b": ("ouro", {"num_hidden_layers": 48}),
    "tiny": (
        "ouro",
        {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 2048,
        },
    ),
    "nanbeige4.2-3b": ("nanbeige", {}),
    # Nanbeige's head ratio (GQA 6:1, head_dim twice hidden / heads) at a CPU test's size.
    "nanbeige-tiny": (
        "nanbeige",
        {
            "vocab_size": 512,
            "hidden_size": 48,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 6,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "kv_channels": 16,
            "max_position_embeddings": 2048,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "huginn-0125": ("huginn_raven", {}),
    # Huginn's stage split (2-4-2 at full size: 1-2-1 here) and MHA at a CPU test's size.
    "huginn-tiny": (
        "huginn_raven",
        {
            "vocab_size": 512,
            "padded_vocab_size": 512,
            "n_embd": 64,
            "n_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 16,
            "intermediate_size": 128,
            "n_layers": 4,
            "n_layers_in_prelude": 1,
            "n_layers_in_recurrent_block": 2,
            "n_layers_in_coda": 1,
            "mean_recurrence": 4,
            "block_size": 2048,
            "init_values": {"embed_scale": 8.0, "std": (2 / (5 * 64)) ** 0.5},
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
}


def preset_config(name: str, overrides: dict[str, Any] | None = None) -> LoopedConfig:
    """The config of a named preset, with HF config.json fields in `overrides` changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    family, changes = PRESETS[name]
    base = FAMILIES[family]().to_hf_dict()
    return config_from_dict(base | changes | (overrides or {}))
