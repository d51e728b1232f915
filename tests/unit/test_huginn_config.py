"""Huginn-0125's published config.json parses into the staged model's shape; the Raven options the
released checkpoint does not use are refused by name, and so are inconsistent stage splits and
aliases; the expected tensors are the official module tree's names and shapes."""

from __future__ import annotations

import math

import pytest

from loopserve.models.families import config_from_dict
from loopserve.models.huginn_config import HuginnConfig
from loopserve.models.loader import expected_tensors
from loopserve.models.model_config import ConfigError
from tests.published_configs import HUGINN_0125_CONFIG


def test_the_published_config_gives_huginn_0125() -> None:
    config = config_from_dict(HUGINN_0125_CONFIG)
    assert isinstance(config, HuginnConfig) and config.family == "huginn"
    shape = (config.hidden_size, config.num_attention_heads, config.head_dim)
    assert shape == (5280, 55, 96) and config.num_key_value_heads == 55
    stages = (config.prelude_layers, config.num_hidden_layers, config.coda_layers)
    assert stages == (2, 4, 2) and config.num_stage_layers == 4 and config.num_loops == 32
    assert (config.vocab_size, config.max_position_embeddings) == (65536, 4096)
    assert config.tie_word_embeddings and config.qk_bias and config.rope_theta == 50000.0
    assert math.isclose(config.embed_scale, math.sqrt(5280))
    assert math.isclose(config.state_std, math.sqrt(2 / (5 * 5280)))
    assert config.eos_token_ids == (65505,) and config.early_exit_threshold == 1.0
    assert config_from_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("injection_type", "add"),
        ("state_init", "zero"),
        ("bias", True),
        ("test_time_noise", 0.5),
        ("mlp_class_name", "BaseMLP"),
        ("norm_class_name", "LayerNorm"),
        ("block_class_name", "TransformerPreNormBlock"),
        ("nonlin_name", "GELU"),
    ],
)
def test_unused_architecture_options_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"config field '{field}' = .* is not supported"):
        config_from_dict(HUGINN_0125_CONFIG | {field: value})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_layers": 9}, r"n_layers \(9\) must equal .* \(2 \+ 4 \+ 2\)"),
        ({"num_key_value_heads": 5}, r"num_key_value_heads \(5\) must equal n_heads \(55\)"),
        ({"padded_vocab_size": 65600}, "padded_vocab_size .* must equal vocab_size"),
        ({"hidden_size": 4096}, "'hidden_size' and 'n_embd' disagree"),
        ({"tie_word_embeddings": False}, "'tie_word_embeddings' and 'tie_embeddings' disagree"),
        ({"head_dim": 64}, "head_dim 64 x n_heads 55 must equal n_embd 5280"),
        ({"recurrent_magic": 1}, r"unknown config field\(s\) \['recurrent_magic'\]"),
        ({"architectures": ["RavenModel"]}, "does not include 'RavenForCausalLM'"),
    ],
)
def test_inconsistent_configs_are_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict(HUGINN_0125_CONFIG | changes)


def test_expected_tensors_are_the_official_module_tree() -> None:
    tensors = expected_tensors(config_from_dict(HUGINN_0125_CONFIG))
    assert tensors["transformer.wte.weight"] == (65536, 5280)
    assert tensors["transformer.adapter.weight"] == (5280, 10560)
    assert tensors["transformer.prelude.1.attn.Wqkv.weight"] == (3 * 5280, 5280)
    assert tensors["transformer.core_block.3.attn.qk_bias"] == (2, 1, 55, 96)
    assert tensors["transformer.coda.0.mlp.fc.weight"] == (2 * 17920, 5280)
    assert tensors["transformer.coda.1.norm_4.weight"] == (5280,)
    assert tensors["transformer.ln_f.weight"] == (5280,)
    assert "lm_head.weight" not in tensors  # tied to the embedding
    assert len(tensors) == 1 + 8 * 9 + 2
