"""The Nanbeige4.2 model configuration (`NanbeigeForCausalLM`), read from and written to an HF
`config.json`.

Owns: Nanbeige's own fields: `num_loops`, `loop_loss_weights` (a training setting; non-empty, it
implies `len + 1` loops, which must agree with `num_loops`), `skip_loop_final_norm`, `kv_channels`
(another name for the head size) and the architecture options of the Nanbeige config class that
the released checkpoint leaves off (shared-KV loops, LoopSplit, hyper-connections, mHC, depth
attention, QK norm, n-gram embeddings): each is refused by name when switched on, and the
parameters that only matter while their option is on are accepted and ignored. Must not: import
torch.
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

# Nanbeige's fields with a value loopserve checks, besides every family's.
_FIXED_FIELDS: dict[str, tuple[Any, ...]] = {"pretraining_tp": (1, None)}
# Architecture options loopserve does not implement -> what they do; each must be off (false,
# null, 0 or empty).
UNSUPPORTED_OPTIONS = {
    "loop_share_kv": "every loop reads one shared K/V",
    "enable_double_loop_split": "LoopSplit: outer layers unlooped, a middle block repeated",
    "loop_middle_layers": "loops over a middle block of layers only",
    "enable_hyper_connection": "hyper-connections around attention and MLP",
    "enable_mhc": "manifold-constrained hyper-connections",
    "enable_h_res_identity": "the hyper-connection residual identity",
    "enable_depth_attention": "attention over cached depths",
    "qk_layernorm": "RMSNorm on queries and keys",
    "emb_neighbor_num": "n-gram neighbour embeddings",
    "insert_ngram_layer_idx": "n-gram embeddings inserted at layers",
    "ngram_insert_all_layers": "n-gram embeddings at every layer",
}
# Parameters of the options above, read by the Nanbeige code only while their option is on.
_OPTION_PARAMETERS = frozenset(
    {
        "emb_split_num",
        "ngram_vocab_size_ratio",
        "ngram_fused_mode",
        "ngram_compressed_tokenizer",
        "mhc_sinkhorn_iterations",
        "hyper_connection_rate",
        "depth_attention_anchors",
    }
)
_NANBEIGE_FIELDS = (
    frozenset({"num_loops", "loop_loss_weights", "skip_loop_final_norm", "kv_channels"})
    | UNSUPPORTED_OPTIONS.keys()
    | _OPTION_PARAMETERS
)


@dataclass(frozen=True, slots=True)
class NanbeigeConfig(LoopedConfig):
    """Shape and constants of a Nanbeige4.2 model; the defaults are Nanbeige4.2-3B's."""

    family: ClassVar[str] = "nanbeige"
    has_exit_rule: ClassVar[bool] = False

    vocab_size: int = 166144
    hidden_size: int = 3072
    intermediate_size: int = 10752
    num_hidden_layers: int = 22
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-5
    rope_theta: float = 70_000_000.0
    num_loops: int = 2
    bos_token_id: int | None = 166100
    eos_token_ids: tuple[int, ...] = (166101,)
    # False: the final norm ends every loop (the next loop reads the normed state); True: only
    # the last loop's output is normed.
    skip_loop_final_norm: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NanbeigeConfig:
        check_fields(
            raw, "nanbeige", "NanbeigeForCausalLM", _NANBEIGE_FIELDS, _FIXED_FIELDS, loads_fp8=True
        )
        enabled = [name for name in UNSUPPORTED_OPTIONS if raw.get(name)]
        if enabled:
            described = "; ".join(f"{name} ({UNSUPPORTED_OPTIONS[name]})" for name in enabled)
            raise ConfigError(
                f"Nanbeige option(s) not supported: {described}. The released Nanbeige4.2 "
                "checkpoints leave them off; loopserve implements the plain looped stack only"
            )
        fields = common_fields(raw)
        head_dim, kv_channels = raw.get("head_dim"), raw.get("kv_channels")
        if head_dim is None and kv_channels is not None:
            fields["head_dim"] = int(kv_channels)
        elif head_dim is not None and kv_channels is not None and head_dim != kv_channels:
            raise ConfigError(f"head_dim ({head_dim}) and kv_channels ({kv_channels}) disagree")
        loops = raw.get("num_loops", 1)
        if isinstance(loops, bool) or not isinstance(loops, int):
            raise ConfigError(f"config field 'num_loops' must be an integer, got {loops!r}")
        weights = raw.get("loop_loss_weights") or []
        if weights and len(weights) + 1 != loops:
            raise ConfigError(
                f"loop_loss_weights has {len(weights)} entries, which implies "
                f"{len(weights) + 1} loops, but num_loops is {loops}"
            )
        return cls(
            **fields,
            num_loops=loops,
            skip_loop_final_norm=bool(raw.get("skip_loop_final_norm", False)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["NanbeigeForCausalLM"],
            "model_type": "nanbeige",
            **common_hf_fields(self),
            "kv_channels": self.head_dim,
            "attention_bias": False,
            "num_loops": self.num_loops,
            "loop_loss_weights": [],
            "skip_loop_final_norm": self.skip_loop_final_norm,
            "pretraining_tp": 1,
            "pad_token_id": 0,
        }
