"""The published config.json of each non-Ouro family loopserve serves, as data, and checkpoints
written from them with random weights.

Nanbeige4.2-3B's is the file as reproduced in public model documentation (this workplace cannot
reach the model hub; the keys and values are those of Nanbeige/Nanbeige4.2-3B's config.json:
the `auto_map` of its remote code, `kv_channels`, `loop_loss_weights`, `skip_loop_final_norm`,
`pretraining_tp`, the bos/eos/pad ids). `SCALED_DOWN_NANBEIGE` keeps its head ratio (GQA 6:1,
head_dim 128 > hidden / heads) and shrinks what costs CPU time.

Huginn-0125's is, the same way, the file as reproduced from the Raven config class of its official
code (`raven_config_minimal.py`: every field its constructor sets, with the released values, the
`auto_map` of its remote code and the special-token ids of its tokenizer). `SCALED_DOWN_HUGINN`
keeps its stage split (2-4-2), recurrence (32) and head_dim-to-width rule and shrinks the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loopserve.models.checkpoint_writer import random_state_dict, write_checkpoint
from loopserve.models.families import config_from_dict
from tests.real_ouro import scripted_weights, write_chat_tokenizer

NANBEIGE_4_2_3B_CONFIG: dict[str, Any] = {
    "architectures": ["NanbeigeForCausalLM"],
    "model_type": "nanbeige",
    "auto_map": {
        "AutoConfig": "configuration_nanbeige.NanbeigeConfig",
        "AutoModel": "modeling_nanbeige.NanbeigeModel",
        "AutoModelForCausalLM": "modeling_nanbeige.NanbeigeForCausalLM",
    },
    "vocab_size": 166144,
    "hidden_size": 3072,
    "intermediate_size": 10752,
    "num_hidden_layers": 22,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "kv_channels": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rope_theta": 70000000,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "num_loops": 2,
    "loop_loss_weights": [],
    "skip_loop_final_norm": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 166100,
    "eos_token_id": 166101,
    "torch_dtype": "bfloat16",
}
HUGINN_0125_CONFIG: dict[str, Any] = {
    "architectures": ["RavenForCausalLM"],
    "model_type": "huginn_raven",
    "auto_map": {
        "AutoConfig": "raven_config_minimal.RavenConfig",
        "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
    },
    "activation_checkpoint_impl": "per-iteration",
    "architecture_class_name": "RecurrentGPT",
    "bias": False,
    "block_class_name": "SandwichBlock",
    "block_size": 4096,
    "bos_token_id": 65504,
    "eos_token_id": 65505,
    "pad_token_id": 65509,
    "effective_expected_depth": 132,
    "head_dim": 96,
    "init_orthogonal": False,
    "init_strategy": "takase",
    "init_values": {
        "embed_scale": 72.6636084983398,
        "embedding": 0.008703882797784892,
        "out_proj": 0.0005356869554443541,
        "std": 0.008703882797784892,
    },
    "injection_type": "linear",
    "intermediate_size": 17920,
    "mean_backprop_depth": 8,
    "mean_recurrence": 32,
    "mlp_class_name": "GatedMLP",
    "n_embd": 5280,
    "n_heads": 55,
    "n_layers": 8,
    "n_layers_in_coda": 2,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
    "norm_eps": 1e-06,
    "num_key_value_heads": 55,
    "padded_vocab_size": 65536,
    "padding_multiple": 4096,
    "qk_bias": True,
    "rope_base": 50000,
    "sampling_scheme": "poisson-lognormal-filling",
    "state_init": "like-init",
    "tie_embeddings": True,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.2",
    "vocab_size": 65536,
}
# CPU-sized: hidden 64 under 4 heads of 16, a 512-token vocabulary, the released stage split.
SCALED_DOWN_HUGINN: dict[str, Any] = {
    "n_embd": 64,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "padded_vocab_size": 512,
    "init_values": {"embed_scale": 8.0, "embedding": 0.079, "out_proj": 0.0049, "std": 0.079},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# CPU-sized: 2 layers, hidden 96 under 6 query heads of 32 and one KV head, a 512-token vocabulary.
SCALED_DOWN_NANBEIGE = {
    "vocab_size": 512,
    "hidden_size": 96,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "kv_channels": 32,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_nanbeige_checkpoint(directory: Path, full_size: bool = False) -> Path:
    """A checkpoint whose config.json is the published one (`full_size`) or the published one
    scaled down, verbatim; bf16 weights scripted as `tests.real_ouro`'s (after any token the
    model writes "Hello", after "Hello" `<|im_end|>`, id 2, the scaled config's eos), with that
    module's tokenizer and ChatML template (which writes `<think>` when asked)."""
    raw = NANBEIGE_4_2_3B_CONFIG if full_size else NANBEIGE_4_2_3B_CONFIG | SCALED_DOWN_NANBEIGE
    answer_id = write_chat_tokenizer(directory, eos_token="<|im_end|>")
    config = config_from_dict(raw)
    write_checkpoint(directory, config, scripted_weights(config, answer_id))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    generation = {"bos_token_id": raw["bos_token_id"], "eos_token_id": raw["eos_token_id"]}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def write_huginn_checkpoint(directory: Path, full_size: bool = False) -> Path:
    """A checkpoint whose config.json is Huginn-0125's (`full_size`) or it scaled down, verbatim,
    with random bf16 weights under the published tensor names and a ChatML tokenizer."""
    raw = HUGINN_0125_CONFIG if full_size else HUGINN_0125_CONFIG | SCALED_DOWN_HUGINN
    config = config_from_dict(raw)
    write_chat_tokenizer(directory, eos_token="<|im_end|>")
    write_checkpoint(directory, config, random_state_dict(config, seed=0, dtype=torch.bfloat16))
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    generation = {key: raw[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


if __name__ == "__main__":
    import sys

    family, target = sys.argv[1], Path(sys.argv[2])
    writers = {"nanbeige": write_nanbeige_checkpoint, "huginn": write_huginn_checkpoint}
    print(writers[family](target, full_size=True))
