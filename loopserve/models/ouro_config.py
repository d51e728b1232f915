"""The Ouro model configuration, read from (and written to) an HF `config.json`.

Owns: Ouro's own config.json fields (`total_ut_steps`, `early_exit_threshold`, `layer_types`, the
sliding-window fields it writes switched off), as written by the transformers versions Ouro was
published with and by current ones, and rejecting the values loopserve does not implement, saying
why. The fields every family shares are `model_config`'s. Must not: import torch, or hold
anything resolved at run time (the dtype the engine runs in, device, KV size): `weights_dtype` is
what the checkpoint declares, not what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from loopserve.models.model_config import (
    ConfigError,
    LoopedConfig,
    check_fields,
    common_fields,
    common_hf_fields,
)

# Ouro's fields with a value loopserve checks, besides every family's (the field -> the accepted
# values).
_FIXED_FIELDS: dict[str, tuple[Any, ...]] = {
    "use_sliding_window": (False, None),
    "early_exit_step": (None,),
}
_OURO_FIELDS = frozenset(
    {"total_ut_steps", "early_exit_threshold", "layer_types", "sliding_window", "max_window_layers"}
)


@dataclass(frozen=True, slots=True)
class OuroConfig(LoopedConfig):
    """Shape and constants of an Ouro model; the defaults are Ouro-1.4B's (`LoopedConfig`'s)."""

    family: ClassVar[str] = "ouro"
    has_exit_rule: ClassVar[bool] = True
    exit_criteria: ClassVar[tuple[str, ...]] = ("gate",)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> OuroConfig:
        """Parse an HF config dict, rejecting anything that would change the math we implement."""
        check_fields(raw, "ouro", "OuroForCausalLM", _OURO_FIELDS, _FIXED_FIELDS, loads_fp8=True)
        layer_types = raw.get("layer_types")
        if layer_types is not None and any(kind != "full_attention" for kind in layer_types):
            raise ConfigError(
                "layer_types other than 'full_attention' (sliding window) are not supported"
            )
        return cls(
            **common_fields(raw),
            num_loops=int(raw.get("total_ut_steps", 4)),
            early_exit_threshold=float(raw.get("early_exit_threshold") or 1.0),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` content for this config (what a real Ouro checkpoint carries)."""
        return {
            "architectures": ["OuroForCausalLM"],
            "model_type": "ouro",
            **common_hf_fields(self),
            "total_ut_steps": self.num_loops,
            "early_exit_threshold": self.early_exit_threshold,
            "use_sliding_window": False,
        }
