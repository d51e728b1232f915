"""The Ouro model configuration, read from (and written to) an HF `config.json`.

Owns: parsing and validating the HF config fields loopserve understands (as written by the
transformers versions Ouro was published with and by current ones: `rope_parameters`, `dtype`),
and rejecting the ones it does not, saying why. Must not: import torch, or hold anything resolved
at run time (the dtype the engine runs in, device, KV size): `weights_dtype` is what the checkpoint
declares, not what runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that loopserve cannot run, with the reason and how to fix it."""


# Fields of a PretrainedConfig that do not change the forward pass; they are accepted and ignored.
_IGNORED_FIELDS = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "auto_map",
        "attention_dropout",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "torchscript",
        "is_encoder_decoder",
        "is_decoder",
        "tokenizer_class",
        "chunk_size",
        "sliding_window",
        "max_window_layers",
        "pad_token_id",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "problem_type",
        "task_specific_params",
        "tie_encoder_decoder",
        "pruned_heads",
    }
)

# Fields with a value loopserve checks (the field -> the only accepted values).
_FIXED_FIELDS: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "use_sliding_window": (False, None),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "early_exit_step": (None,),
}

# The rotary embedding variants loopserve implements (HF `rope_type`; "default" is plain RoPE).
SUPPORTED_ROPE_TYPES = ("default",)
# Dtypes a checkpoint may declare for its weights (HF `torch_dtype`, `dtype` in transformers v5).
WEIGHTS_DTYPES = ("float32", "bfloat16", "float16")

_FIELDS_READ = frozenset(
    {
        "model_type",
        "architectures",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "torch_dtype",
        "dtype",
        "quantization_config",
        "total_ut_steps",
        "early_exit_threshold",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "layer_types",
    }
)


@dataclass(frozen=True, slots=True)
class OuroConfig:
    """Shape and constants of an Ouro model; the defaults are Ouro-1.4B's."""

    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 128
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # How many times the shared stack runs per token at full depth (HF: `total_ut_steps`).
    num_loops: int = 4
    # Default exit threshold of the checkpoint; 1.0 means fixed depth.
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = field(default=(0,))
    # The dtype the checkpoint declares for its weights (HF `torch_dtype`); None: not declared.
    weights_dtype: str | None = "bfloat16"

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OuroConfig:
        """Parse an HF config dict, rejecting anything that would change the math we implement."""
        _check_fields(raw)
        heads = _required_int(raw, "num_attention_heads")
        hidden = _required_int(raw, "hidden_size")
        eos = raw.get("eos_token_id", 0)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=_required_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(raw, "intermediate_size"),
            num_hidden_layers=_required_int(raw, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=_required_int(raw, "max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(raw),
            num_loops=int(raw.get("total_ut_steps", 4)),
            early_exit_threshold=float(raw.get("early_exit_threshold") or 1.0),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(token) for token in eos_ids),
            weights_dtype=_weights_dtype(raw),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> OuroConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json; a checkpoint directory needs one") from None
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_dict(raw)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content for this config (what a real Ouro checkpoint carries)."""
        fields = asdict(self)
        eos = fields.pop("eos_token_ids")
        fields["total_ut_steps"] = fields.pop("num_loops")
        weights_dtype = fields.pop("weights_dtype")
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            **fields,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
            "hidden_act": "silu",
            "rope_scaling": None,
            "use_sliding_window": False,
            **({} if weights_dtype is None else {"torch_dtype": weights_dtype}),
        }


def _required_int(raw: dict[str, Any], name: str) -> int:
    if name not in raw:
        raise ConfigError(f"config field '{name}' is missing")
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field '{name}' must be an integer, got {value!r}")
    return value


def _check_fields(raw: dict[str, Any]) -> None:
    if raw.get("model_type") != "ouro":
        raise ConfigError(
            f"model_type is {raw.get('model_type')!r}; loopserve runs Ouro models "
            "(model_type 'ouro') only"
        )
    architectures = raw.get("architectures") or ["OuroForCausalLM"]
    if "OuroForCausalLM" not in architectures:
        raise ConfigError(f"architectures {architectures} does not include 'OuroForCausalLM'")
    for name, accepted in _FIXED_FIELDS.items():
        if name in raw and raw[name] not in accepted:
            raise ConfigError(
                f"config field '{name}' = {raw[name]!r} is not supported "
                f"(loopserve implements {accepted[0]!r} only)"
            )
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ConfigError(
            f"quantized checkpoints are not supported yet (quantization_config, quant_method "
            f"{method!r}); use the unquantized checkpoint (BF16 weights)"
        )
    layer_types = raw.get("layer_types")
    if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
        raise ConfigError(
            "layer_types other than 'full_attention' (sliding window) are not supported"
        )
    known = _IGNORED_FIELDS | _FIELDS_READ | _FIXED_FIELDS.keys()
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(
            f"unknown config field(s) {unknown}: loopserve does not know whether they change the "
            "model; remove them from config.json if they do not"
        )


def _rope_type(entry: Any, name: str) -> str:
    """The rope type of a `rope_scaling` / `rope_parameters` entry ("type" is the old key)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"config field '{name}' must be an object, got {entry!r}")
    rope_type = entry.get("rope_type", entry.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"config field '{name}' asks for rope_type {rope_type!r}, which loopserve does not "
            f"implement yet (it implements {', '.join(map(repr, SUPPORTED_ROPE_TYPES))}: plain "
            "RoPE); such a checkpoint would give wrong outputs, so it is refused"
        )
    return str(rope_type)


def _rope_theta(raw: dict[str, Any]) -> float:
    """RoPE's base from `rope_theta` or (transformers v5) `rope_parameters`; the rope type must be
    one loopserve implements, in `rope_scaling` and `rope_parameters` alike."""
    theta = raw.get("rope_theta")
    for name in ("rope_scaling", "rope_parameters"):
        entry = raw.get(name)
        if entry is None:
            continue
        _rope_type(entry, name)
        nested = entry.get("rope_theta")
        if nested is not None and theta is not None and float(nested) != float(theta):
            raise ConfigError(
                f"config fields 'rope_theta' ({theta}) and '{name}.rope_theta' ({nested}) disagree"
            )
        theta = theta if nested is None else nested
    return float(theta if theta is not None else 10000.0)


def _weights_dtype(raw: dict[str, Any]) -> str | None:
    """`torch_dtype` (or `dtype`, its transformers v5 name); None when the config declares none."""
    declared = raw.get("torch_dtype", raw.get("dtype"))
    if declared is None:
        return None
    name = str(declared).removeprefix("torch.")
    if name not in WEIGHTS_DTYPES:
        raise ConfigError(
            f"config field 'torch_dtype' = {declared!r} is not supported (loopserve loads "
            f"{', '.join(WEIGHTS_DTYPES)} weights)"
        )
    return name


def _validate(config: OuroConfig) -> None:
    positive = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "num_loops",
    )
    for name in positive:
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name} must be positive, got {getattr(config, name)}")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads ({config.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({config.num_key_value_heads})"
        )
    if config.head_dim % 2:
        raise ConfigError(f"head_dim must be even for rotary embeddings, got {config.head_dim}")
    if not 0.0 < config.early_exit_threshold <= 1.0:
        raise ConfigError(
            f"early_exit_threshold must be in (0, 1], got {config.early_exit_threshold}"
        )
    if config.rms_norm_eps <= 0 or config.rope_theta <= 0:
        raise ConfigError("rms_norm_eps and rope_theta must be positive")
    for token in config.eos_token_ids:
        if not 0 <= token < config.vocab_size:
            raise ConfigError(f"eos_token_id {token} is outside the vocabulary")
    if config.weights_dtype is not None and config.weights_dtype not in WEIGHTS_DTYPES:
        raise ConfigError(f"weights_dtype must be one of {WEIGHTS_DTYPES} or None")


# Shapes that `loopserve make-checkpoint`, the benchmarks and the tests write (changes from
# Ouro-1.4B's config.json, the defaults above).
PRESETS: dict[str, dict[str, Any]] = {
    "ouro-1.4b": {},
    "ouro-2.6b": {"num_hidden_layers": 48},
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
    },
}


def preset_config(name: str, overrides: dict[str, Any] | None = None) -> OuroConfig:
    """The config of a named preset, with HF config.json fields in `overrides` changed."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return OuroConfig.from_dict(OuroConfig().to_hf_dict() | PRESETS[name] | (overrides or {}))
