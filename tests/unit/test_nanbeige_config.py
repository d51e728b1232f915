"""Nanbeige4.2's config.json: the published file loads as written, the options loopserve does not
implement are refused by name, and a config round-trips through `to_hf_dict`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loopserve.models.families import config_from_dict, preset_config, read_model_config
from loopserve.models.model_config import ConfigError
from loopserve.models.nanbeige_config import UNSUPPORTED_OPTIONS, NanbeigeConfig
from tests.published_configs import NANBEIGE_4_2_3B_CONFIG


def test_the_published_config_loads_with_its_values() -> None:
    config = config_from_dict(NANBEIGE_4_2_3B_CONFIG)
    assert isinstance(config, NanbeigeConfig)
    assert (config.family, config.has_exit_rule) == ("nanbeige", False)
    assert (config.num_hidden_layers, config.num_loops, config.skip_loop_final_norm) == (
        22,
        2,
        False,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (48, 8, 128)
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (
        3072,
        10752,
        166144,
    )
    assert config.rope_theta == 70_000_000.0 and config.rms_norm_eps == 1e-5
    assert (config.bos_token_id, config.eos_token_ids, config.weights_dtype) == (
        166100,
        (166101,),
        "bfloat16",
    )
    assert config.early_exit_threshold == 1.0
    assert config == NanbeigeConfig()  # the class defaults are the published model's


def test_read_model_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(NANBEIGE_4_2_3B_CONFIG | {"hidden_act": "gelu"}))
    with pytest.raises(ConfigError, match=r"config\.json: .*'hidden_act' = 'gelu'"):
        read_model_config(path)


@pytest.mark.parametrize("option", sorted(UNSUPPORTED_OPTIONS))
def test_each_unsupported_option_is_refused_by_name(option: str) -> None:
    value = (
        4 if option == "emb_neighbor_num" else [3] if option == "insert_ngram_layer_idx" else True
    )
    with pytest.raises(ConfigError, match=rf"not supported: {option} \("):
        config_from_dict(NANBEIGE_4_2_3B_CONFIG | {option: value})


@pytest.mark.parametrize("option", sorted(UNSUPPORTED_OPTIONS))
def test_options_switched_off_are_accepted(option: str) -> None:
    value = (
        []
        if option == "insert_ngram_layer_idx"
        else None
        if option == "emb_neighbor_num"
        else False
    )
    assert config_from_dict(NANBEIGE_4_2_3B_CONFIG | {option: value}).num_loops == 2


def test_loop_count_rules() -> None:
    three = config_from_dict(NANBEIGE_4_2_3B_CONFIG | {"num_loops": 3, "loop_loss_weights": [1, 1]})
    assert three.num_loops == 3
    with pytest.raises(ConfigError, match="implies 3 loops, but num_loops is 2"):
        config_from_dict(NANBEIGE_4_2_3B_CONFIG | {"loop_loss_weights": [0.5, 0.5]})
    with pytest.raises(ConfigError, match="num_loops must be positive"):
        config_from_dict(NANBEIGE_4_2_3B_CONFIG | {"num_loops": 0})


def test_head_size_from_kv_channels() -> None:
    raw = {k: v for k, v in NANBEIGE_4_2_3B_CONFIG.items() if k != "head_dim"}
    assert config_from_dict(raw).head_dim == 128
    with pytest.raises(ConfigError, match=r"head_dim \(128\) and kv_channels \(64\) disagree"):
        config_from_dict(NANBEIGE_4_2_3B_CONFIG | {"kv_channels": 64})


def test_unknown_fields_and_other_families_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown config field\(s\) \['loop_magic'\]"):
        config_from_dict(NANBEIGE_4_2_3B_CONFIG | {"loop_magic": 1})
    with pytest.raises(
        ConfigError, match="runs the looped families 'ouro', 'nanbeige', 'huginn_raven' only"
    ):
        config_from_dict(NANBEIGE_4_2_3B_CONFIG | {"model_type": "llama"})


def test_no_exit_gate_means_fixed_depth() -> None:
    with pytest.raises(ConfigError, match="no exit rule"):
        NanbeigeConfig(early_exit_threshold=0.5)


@pytest.mark.parametrize("skip", [False, True])
def test_round_trip_through_the_hf_dict(skip: bool) -> None:
    config = preset_config("nanbeige-tiny", {"skip_loop_final_norm": skip, "num_loops": 3})
    assert config_from_dict(config.to_hf_dict()) == config
