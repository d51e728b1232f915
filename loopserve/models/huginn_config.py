"""The Huginn-0125 model configuration (`RavenForCausalLM`, model_type `huginn_raven`), read from
and written to an HF `config.json`.

Owns: Huginn's field names (`n_embd`, `n_heads`, `n_layers`, `n_layers_in_prelude`,
`n_layers_in_recurrent_block`, `n_layers_in_coda`, `mean_recurrence`, `rope_base`, `norm_eps`,
`block_size`, `padded_vocab_size`, `tie_embeddings`, `qk_bias`, `init_values`) mapped onto
`LoopedConfig` (whose `num_hidden_layers` is the recurrent block's layer count and `num_loops`
its default recurrence), the stage split, and the architecture choices of the Raven config class
that the released checkpoint does not use, refused by name. The training-only fields (the
initialisation scheme, the recurrence sampler, backprop depth, activation checkpointing) are
accepted and ignored. Must not: import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from loopserve.models.model_config import (
    ConfigError,
    LoopedConfig,
    check_fields,
    required_int,
    weights_dtype,
)

# The official adaptive generation's convergence criteria -> the threshold its "auto" gives them
# (raven_modeling_minimal.py); `argmax-stability` counts loops instead and is not offered.
CONVERGENCE_THRESHOLDS = {"latent-diff": 0.03, "entropy-diff": 1e-3, "kl": 5e-4, "minp-kl": 1e-6}
# Architecture choices -> the one value loopserve implements (the released checkpoint's).
_FIXED_FIELDS: dict[str, tuple[Any, ...]] = {
    "architecture_class_name": ("RecurrentGPT",),
    "block_class_name": ("SandwichBlock",),
    "norm_class_name": ("RMSNorm_llama",),
    "mlp_class_name": ("GatedMLP",),
    "nonlin_name": ("SiLU",),
    "injection_type": ("linear",),
    "state_init": ("like-init",),
    "bias": (False,),
    "test_time_noise": (0, 0.0),
    "test_time_noise_type": ("none", "fixed", "geom", "sqrt", "line", "chi"),
}
# Fields only training reads (initialisation, the recurrence sampler, checkpointing).
_TRAINING_FIELDS = frozenset(
    {
        "init_strategy",
        "init_orthogonal",
        "sampling_scheme",
        "mean_backprop_depth",
        "activation_checkpoint_impl",
        "padding_multiple",
        "effective_expected_depth",
    }
)
_HUGINN_FIELDS = _TRAINING_FIELDS | {
    "n_embd",
    "n_heads",
    "n_layers",
    "n_layers_in_prelude",
    "n_layers_in_recurrent_block",
    "n_layers_in_coda",
    "mean_recurrence",
    "rope_base",
    "norm_eps",
    "block_size",
    "padded_vocab_size",
    "tie_embeddings",
    "qk_bias",
    "init_values",
}


@dataclass(frozen=True, slots=True)
class HuginnConfig(LoopedConfig):
    """Shape and constants of a Huginn model; the defaults are Huginn-0125's."""

    family: ClassVar[str] = "huginn"
    has_exit_rule: ClassVar[bool] = True  # its exit rule: convergence between loops
    exit_criteria: ClassVar[tuple[str, ...]] = tuple(CONVERGENCE_THRESHOLDS)

    vocab_size: int = 65536
    hidden_size: int = 5280
    intermediate_size: int = 17920
    num_hidden_layers: int = 4  # the recurrent block
    num_attention_heads: int = 55
    num_key_value_heads: int = 55
    head_dim: int = 96
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 50_000.0
    num_loops: int = 32
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 65504
    eos_token_ids: tuple[int, ...] = (65505,)
    prelude_layers: int = 2
    coda_layers: int = 2
    qk_bias: bool = True
    # The embedding is multiplied by this; the random initial state is a normal of std
    # `state_std`, truncated at 3 std, times `embed_scale` (config `init_values`).
    embed_scale: float = math.sqrt(5280)
    state_std: float = math.sqrt(2 / (5 * 5280))

    def __post_init__(self) -> None:
        LoopedConfig.__post_init__(self)
        if self.prelude_layers < 0 or self.coda_layers < 0:
            raise ConfigError("n_layers_in_prelude and n_layers_in_coda must not be negative")
        if self.num_attention_heads * self.head_dim != self.hidden_size:
            raise ConfigError(
                f"head_dim {self.head_dim} x n_heads {self.num_attention_heads} must equal "
                f"n_embd {self.hidden_size} (Huginn's attention projects back to n_embd)"
            )

    @property
    def num_stage_layers(self) -> int:
        return self.prelude_layers + self.coda_layers

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HuginnConfig:
        check_fields(raw, "huginn_raven", "RavenForCausalLM", _HUGINN_FIELDS, _FIXED_FIELDS)
        hidden, heads = required_int(raw, "n_embd"), required_int(raw, "n_heads")
        # The Raven config class's aliases (HF `attribute_map`), where a file carries them too.
        aliases = {
            "hidden_size": ("n_embd", hidden),
            "num_attention_heads": ("n_heads", heads),
            "num_hidden_layers": ("n_layers", raw.get("n_layers")),
            "tie_word_embeddings": ("tie_embeddings", raw.get("tie_embeddings", True)),
        }
        for alias, (name, value) in aliases.items():
            if alias in raw and raw[alias] != value:
                raise ConfigError(f"config fields '{alias}' and '{name}' disagree")
        prelude = required_int(raw, "n_layers_in_prelude")
        block = required_int(raw, "n_layers_in_recurrent_block")
        coda = required_int(raw, "n_layers_in_coda")
        total = raw.get("n_layers", prelude + block + coda)
        if total != prelude + block + coda:
            raise ConfigError(
                f"n_layers ({total}) must equal n_layers_in_prelude + n_layers_in_recurrent_block "
                f"+ n_layers_in_coda ({prelude} + {block} + {coda})"
            )
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if kv_heads != heads:
            raise ConfigError(
                f"num_key_value_heads ({kv_heads}) must equal n_heads ({heads}): Huginn's "
                "attention splits Wqkv into n_embd + 2 x n_embd (every head has its own K/V)"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        vocab = required_int(raw, "vocab_size")
        padded = raw.get("padded_vocab_size", vocab)
        if padded != vocab:
            raise ConfigError(
                f"padded_vocab_size ({padded}) must equal vocab_size ({vocab}) (the Raven config "
                "class sets both to one value)"
            )
        init = raw.get("init_values") or {}
        if not isinstance(init, dict):
            raise ConfigError(f"config field 'init_values' must be an object, got {init!r}")
        eos = raw.get("eos_token_id", 65505)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=required_int(raw, "intermediate_size"),
            num_hidden_layers=block,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("block_size", 4096)),
            rms_norm_eps=float(raw.get("norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_base", 50_000)),
            num_loops=required_int(raw, "mean_recurrence"),
            tie_word_embeddings=bool(raw.get("tie_embeddings", True)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(int(token) for token in eos_ids),
            weights_dtype=weights_dtype(raw),
            prelude_layers=prelude,
            coda_layers=coda,
            qk_bias=bool(raw.get("qk_bias", False)),
            embed_scale=float(init.get("embed_scale", math.sqrt(hidden))),
            state_std=float(init.get("std", math.sqrt(2 / (5 * hidden)))),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        eos = self.eos_token_ids
        block = self.num_hidden_layers
        return {
            "architectures": ["RavenForCausalLM"],
            "model_type": "huginn_raven",
            "architecture_class_name": "RecurrentGPT",
            "block_class_name": "SandwichBlock",
            "norm_class_name": "RMSNorm_llama",
            "mlp_class_name": "GatedMLP",
            "nonlin_name": "SiLU",
            "injection_type": "linear",
            "state_init": "like-init",
            "bias": False,
            "n_embd": self.hidden_size,
            "n_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "n_layers": self.prelude_layers + block + self.coda_layers,
            "n_layers_in_prelude": self.prelude_layers,
            "n_layers_in_recurrent_block": block,
            "n_layers_in_coda": self.coda_layers,
            "mean_recurrence": self.num_loops,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "padded_vocab_size": self.vocab_size,
            "block_size": self.max_position_embeddings,
            "norm_eps": self.rms_norm_eps,
            "rope_base": self.rope_theta,
            "qk_bias": self.qk_bias,
            "tie_embeddings": self.tie_word_embeddings,
            "init_values": {"embed_scale": self.embed_scale, "std": self.state_std},
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else list(eos),
            **({} if self.weights_dtype is None else {"torch_dtype": self.weights_dtype}),
        }
