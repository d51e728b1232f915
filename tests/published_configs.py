"""The published config.json of each non-Ouro family loopserve serves, as data, and checkpoints
written from them with random weights.

Nanbeige4.2-3B's is the file as reproduced in public model documentation (this workplace cannot
reach the model hub; the keys and values are those of Nanbeige/Nanbeige4.2-3B's config.json:
the `auto_map` of its remote code, `kv_channels`, `loop_loss_weights`, `skip_loop_final_norm`,
`pretraining_tp`, the bos/eos/pad ids). `SCALED_DOWN_NANBEIGE` keeps its head ratio (GQA 6:1,
head_dim 128 > hidden / heads) and shrinks what costs CPU time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loopserve.models.checkpoint_writer import write_checkpoint
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


if __name__ == "__main__":
    import sys

    print(write_nanbeige_checkpoint(Path(sys.argv[1]), full_size=True))
