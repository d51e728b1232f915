"""What every looped family's configuration holds, and the config.json parsing the families share.

Owns: `ConfigError`, `LoopedConfig` (the fields the engine, the runner, the KV sizing and the
reference read whatever the family) and the parsing rules every family applies the same way: the
PretrainedConfig fields that never change the forward pass, required integers, RoPE's base and
type, the declared weights dtype, quantized checkpoints refused, unknown fields refused by name.
Must not: import torch, or know a family's own fields (each family's module parses those).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A config.json that loopserve cannot run, with the reason and how to fix it."""


# Fields of a PretrainedConfig that do not change the forward pass; they are accepted and ignored.
IGNORED_FIELDS = frozenset(
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
# The fields `common_fields` reads (a family adds its own).
COMMON_FIELDS = frozenset(
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
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    }
)
# Fields with a value every family's implementation fixes (the field -> the accepted values, the
# first one the implemented one); a family adds its own.
COMMON_FIXED_FIELDS: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu",),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
}
# The rotary embedding variants loopserve implements (HF `rope_type`; "default" is plain RoPE).
SUPPORTED_ROPE_TYPES = ("default",)
# Dtypes a checkpoint may declare for its weights (HF `torch_dtype`, `dtype` in transformers v5).
WEIGHTS_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class LoopedConfig:
    """Shape and constants of a looped model that every family has.

    The recurrent block is `num_hidden_layers` layers run up to `num_loops` times per token; each
    layer of it keeps K/V per loop (or one copy, in the `shared` layout). The defaults are
    Ouro-1.4B's; each family's subclass sets its own.
    """

    # The family's name and whether it has an exit rule of its own (an exit hazard per loop:
    # Ouro's gate, Huginn's convergence test).
    family: ClassVar[str] = ""
    has_exit_rule: ClassVar[bool] = False
    # The family's exit criteria (`exit_criterion`), its default first; none without a rule.
    exit_criteria: ClassVar[tuple[str, ...]] = ()

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
    # How many times the recurrent block runs per token at full depth.
    num_loops: int = 4
    # Default exit threshold of the checkpoint; 1.0 means fixed depth (always, without a gate).
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = field(default=(0,))
    # The dtype the checkpoint declares for its weights (HF `torch_dtype`); None: not declared.
    weights_dtype: str | None = "bfloat16"
    # "fp8": the checkpoint stores its layers' projections as float8 e4m3 with `weight_scale`
    # tensors (`quantization_config`, `checkpoint_quantization`); None: unquantized.
    checkpoint_quantization: str | None = None

    def __post_init__(self) -> None:
        validate_common(self)

    def resolve_exit_criterion(self, name: str, setting: str = "exit_criterion") -> str:
        """The exit criterion an engine runs: `name`, or (empty) the family's default. An error
        names the setting as `setting` says (the engine passes its flag too)."""
        if not name:
            return self.exit_criteria[0] if self.exit_criteria else ""
        if name not in self.exit_criteria:
            offered = ", ".join(self.exit_criteria) or "none: it has no exit rule"
            raise ConfigError(
                f"{setting} {name!r} is not one of {self.family or 'this family'}'s ({offered})"
            )
        return name

    @property
    def num_stage_layers(self) -> int:
        """Prelude and coda layers: run once per token, outside the loops (their K/V have one
        version, kept in a request's last plane)."""
        return 0

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LoopedConfig:
        """Parse an HF config dict, rejecting anything that would change the math implemented."""
        raise NotImplementedError

    @classmethod
    def from_file(cls, path: str | Path) -> LoopedConfig:
        return parse_config_file(path, cls.from_dict)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content for this config (what a real checkpoint carries)."""
        raise NotImplementedError


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config.json, or a ConfigError that names the file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json; a checkpoint directory needs one") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw


def parse_config_file(
    path: str | Path, parse: Callable[[dict[str, Any]], LoopedConfig]
) -> LoopedConfig:
    """`parse` of a config.json's object; every error names the file."""
    try:
        return parse(read_config_json(path))
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The `LoopedConfig` fields every family writes alike, as constructor keywords (the loop
    count and the exit threshold are the family's)."""
    heads = required_int(raw, "num_attention_heads")
    hidden = required_int(raw, "hidden_size")
    eos = raw.get("eos_token_id", 0)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return {
        "vocab_size": required_int(raw, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": required_int(raw, "intermediate_size"),
        "num_hidden_layers": required_int(raw, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": int(raw.get("head_dim") or hidden // heads),
        "max_position_embeddings": required_int(raw, "max_position_embeddings"),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope_theta": rope_theta(raw),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": tuple(int(token) for token in eos_ids),
        "weights_dtype": weights_dtype(raw),
        "checkpoint_quantization": checkpoint_quantization(raw),
    }


def common_hf_fields(config: LoopedConfig) -> dict[str, Any]:
    """The config.json fields `common_fields` reads back into `config`."""
    eos = config.eos_token_ids
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
        **({} if config.weights_dtype is None else {"torch_dtype": config.weights_dtype}),
        **(
            {}
            if config.checkpoint_quantization is None
            else {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
        ),
    }


def check_fields(
    raw: dict[str, Any],
    model_type: str,
    architecture: str,
    known: frozenset[str],
    fixed: dict[str, tuple[Any, ...]],
    loads_fp8: bool = False,
) -> None:
    """Refuse a config.json that is not this family's, asks for values loopserve does not
    implement (`fixed` and `COMMON_FIXED_FIELDS`: field -> the accepted values, the first one the
    implemented one), is quantized (other than as `checkpoint_quantization` reads, in a family
    that `loads_fp8`), or has a field outside `known` | `fixed` | the common and ignored ones."""
    fixed = COMMON_FIXED_FIELDS | fixed
    if raw.get("model_type") != model_type:
        raise ConfigError(f"model_type is {raw.get('model_type')!r}, not {model_type!r}")
    architectures = raw.get("architectures") or [architecture]
    if architecture not in architectures:
        raise ConfigError(f"architectures {architectures} does not include {architecture!r}")
    for name, accepted in fixed.items():
        if name in raw and raw[name] not in accepted:
            raise ConfigError(
                f"config field '{name}' = {raw[name]!r} is not supported "
                f"(loopserve implements {accepted[0]!r} only)"
            )
    if loads_fp8:
        checkpoint_quantization(raw)
    elif raw.get("quantization_config") is not None:
        raise _quantized(raw["quantization_config"], "")
    unknown = sorted(set(raw) - (IGNORED_FIELDS | COMMON_FIELDS | known | fixed.keys()))
    if unknown:
        raise ConfigError(
            f"unknown config field(s) {unknown}: loopserve does not know whether they change the "
            "model; remove them from config.json if they do not"
        )


def required_int(raw: dict[str, Any], name: str) -> int:
    if name not in raw:
        raise ConfigError(f"config field '{name}' is missing")
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field '{name}' must be an integer, got {value!r}")
    return value


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


def rope_theta(raw: dict[str, Any]) -> float:
    """RoPE's base from `rope_theta` or (transformers v5) `rope_parameters`; the rope type must be
    one loopserve implements, in `rope_scaling` and `rope_parameters` alike."""
    theta = raw.get("rope_theta")
    for entry_name in ("rope_scaling", "rope_parameters"):
        entry = raw.get(entry_name)
        if entry is None:
            continue
        _rope_type(entry, entry_name)
        nested = entry.get("rope_theta")
        if nested is not None and theta is not None and float(nested) != float(theta):
            raise ConfigError(
                f"config fields 'rope_theta' ({theta}) and '{entry_name}.rope_theta' ({nested}) "
                "disagree"
            )
        theta = theta if nested is None else nested
    return float(theta if theta is not None else 10000.0)


# The `quantization_config` fields of an fp8 checkpoint (vLLM's and llm-compressor's "fp8"
# format: e4m3 weights, a `weight_scale` per tensor or per output channel, dynamic activations).
FP8_CHECKPOINT_FIELDS = frozenset({"quant_method", "activation_scheme", "fmt", "ignored_layers"})


def checkpoint_quantization(raw: dict[str, Any]) -> str | None:
    """ "fp8" for an fp8 checkpoint loopserve loads, None for an unquantized one; refuses others."""
    quantization = raw.get("quantization_config")
    if quantization is None:
        return None
    fp8 = (
        isinstance(quantization, dict)
        and quantization.get("quant_method") == "fp8"
        and set(quantization) <= FP8_CHECKPOINT_FIELDS
        and quantization.get("activation_scheme", "dynamic") == "dynamic"
        and quantization.get("fmt", "e4m3") == "e4m3"
        and set(quantization.get("ignored_layers") or []) <= {"lm_head"}
    )
    if not fp8:
        raise _quantized(
            quantization,
            "; fp8 checkpoints load with quant_method 'fp8', activation_scheme 'dynamic', e4m3 "
            "weights and one weight_scale per tensor or per output channel (no "
            "weight_block_size, input scales or ignored layers but lm_head)",
        )
    return "fp8"


def _quantized(quantization: Any, detail: str) -> ConfigError:
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    return ConfigError(
        f"quantized checkpoints are not supported yet (quantization_config, quant_method "
        f"{method!r}){detail}; use the unquantized checkpoint (BF16 weights)"
    )


def weights_dtype(raw: dict[str, Any]) -> str | None:
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


def validate_common(config: LoopedConfig) -> None:
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
    if not config.has_exit_rule and config.early_exit_threshold < 1.0:
        raise ConfigError(
            f"{config.family or 'this family'} has no exit rule, so its early_exit_threshold "
            "must be 1.0 (fixed depth)"
        )
    if config.rms_norm_eps <= 0 or config.rope_theta <= 0:
        raise ConfigError("rms_norm_eps and rope_theta must be positive")
    for token in config.eos_token_ids:
        if not 0 <= token < config.vocab_size:
            raise ConfigError(f"eos_token_id {token} is outside the vocabulary")
    if config.weights_dtype is not None and config.weights_dtype not in WEIGHTS_DTYPES:
        raise ConfigError(f"weights_dtype must be one of {WEIGHTS_DTYPES} or None")
