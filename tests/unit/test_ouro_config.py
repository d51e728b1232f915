from __future__ import annotations

import json
import re

import pytest

from loopserve.models.model_config import ConfigError
from loopserve.models.ouro_config import OuroConfig


def hf_dict(**changes: object) -> dict[str, object]:
    return OuroConfig().to_hf_dict() | changes


def test_defaults_are_ouro_1_4b_and_round_trip() -> None:
    config = OuroConfig()
    assert (config.hidden_size, config.num_hidden_layers, config.num_loops) == (2048, 24, 4)
    assert OuroConfig.from_dict(config.to_hf_dict()) == config


def test_real_ouro_fields_are_accepted() -> None:
    raw = hf_dict(
        transformers_version="4.55.0",
        use_cache=True,
        initializer_range=0.02,
        layer_types=["full_attention"] * 24,
        sliding_window=None,
        max_window_layers=28,
        early_exit_threshold=1.0,
        auto_map={"AutoConfig": "configuration_ouro.OuroConfig"},
        attention_dropout=0.0,
    )
    assert OuroConfig.from_dict(raw).num_loops == 4


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "llama"}, "model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"layer_types": ["sliding_attention"] * 24}, "layer_types"),
        ({"num_key_value_heads": 3}, "multiple"),
        ({"frobnication": 7}, "unknown config field(s) ['frobnication']"),
        ({"architectures": ["LlamaForCausalLM"]}, "OuroForCausalLM"),
        ({"hidden_size": "wide"}, "hidden_size"),
        ({"total_ut_steps": 0}, "num_loops"),
    ],
)
def test_unsupported_configs_fail_naming_the_problem(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        OuroConfig.from_dict(hf_dict(**changes))


def test_missing_field_is_named(tmp_path) -> None:
    raw = hf_dict()
    del raw["vocab_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="vocab_size"):
        OuroConfig.from_file(path)


def test_bad_json_names_the_file(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        OuroConfig.from_file(path)


# ----- fields written by current transformers ---------------------------------------------------


def test_rope_parameters_of_transformers_v5_are_read() -> None:
    raw = hf_dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    del raw["rope_theta"]  # v5 moves the base into rope_parameters
    assert OuroConfig.from_dict(raw).rope_theta == 500000.0


@pytest.mark.parametrize(
    "entry",
    [{"rope_type": "default"}, {"type": "default"}, {"rope_type": "default", "rope_theta": 1e6}],
)
@pytest.mark.parametrize("name", ["rope_scaling", "rope_parameters"])
def test_default_rope_type_is_accepted(name: str, entry: dict) -> None:
    config = OuroConfig.from_dict(hf_dict(**{name: entry}))
    assert config.rope_theta == 1_000_000.0


@pytest.mark.parametrize("name", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic", "llama3"])
def test_other_rope_types_are_refused_until_implemented(name: str, rope_type: str) -> None:
    raw = hf_dict(**{name: {"rope_type": rope_type, "factor": 4.0}})
    with pytest.raises(ConfigError, match=f"'{name}' asks for rope_type '{rope_type}'.*not"):
        OuroConfig.from_dict(raw)


def test_disagreeing_rope_bases_are_refused() -> None:
    raw = hf_dict(rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    with pytest.raises(ConfigError, match="disagree"):
        OuroConfig.from_dict(raw)


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "bitsandbytes"])
def test_quantized_checkpoints_are_refused_saying_so(method: str) -> None:
    raw = hf_dict(quantization_config={"quant_method": method, "bits": 4})
    with pytest.raises(
        ConfigError, match=f"quantized checkpoints are not supported yet.*'{method}'"
    ):
        OuroConfig.from_dict(raw)


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("value", ["float32", "bfloat16", "float16"])
def test_declared_weights_dtype_is_read_under_either_name(key: str, value: str) -> None:
    raw = hf_dict()
    del raw["torch_dtype"]
    assert OuroConfig.from_dict(raw | {key: value}).weights_dtype == value
    assert OuroConfig.from_dict(raw).weights_dtype is None


def test_unsupported_weights_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="torch_dtype"):
        OuroConfig.from_dict(hf_dict(torch_dtype="float8_e4m3fn"))
