"""A checkpoint shaped like the published Ouro-1.4B, written by the tests themselves.

config.json holds every key and value of Ouro-1.4B's config.json (transformers 4.55 export:
`eos_token_id` 0, `max_position_embeddings` 65536, `total_ut_steps` 4, `torch_dtype` bfloat16,
the `auto_map` of its remote code, `layer_types`); only the sizes that cost CPU time are scaled
down (hidden 64, SwiGLU 128, 2 layers, a 512-token vocabulary). The heads and head size stay, so a
layer's KV is exactly Ouro-1.4B's and the KV sizing and `max_model_len` defaults are exercised as
a real checkpoint exercises them (65536 positions never fit a CPU's default cache). The tokenizer
is byte-level BPE with Ouro's special tokens (`<|endoftext|>` 0, `<|im_start|>` 1, `<|im_end|>`
2) and a ChatML template in tokenizer_config.json; generation_config.json says eos 0, like Ouro's.

The weights are a scripted model, not noise: every layer adds nothing to the residual stream, so
the next token depends on the current one only. After any token it writes "Hello"; after "Hello"
it writes `<|im_end|>`. So a chat answer is "Hello" and then the end of the turn, whatever the
prompt, at any temperature.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from loopserve.models.checkpoint_writer import random_state_dict, write_checkpoint
from loopserve.models.model_config import LoopedConfig
from loopserve.models.ouro_config import OuroConfig

# Ouro-1.4B's config.json as published (ByteDance/Ouro-1.4B, transformers 4.55.0).
OURO_1_4B_CONFIG: dict[str, Any] = {
    "architectures": ["OuroForCausalLM"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModel": "modeling_ouro.OuroModel",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "bos_token_id": 0,
    "early_exit_threshold": 1.0,
    "eos_token_id": 0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5632,
    "layer_types": ["full_attention"] * 24,
    "max_position_embeddings": 65536,
    "max_window_layers": 24,
    "model_type": "ouro",
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "total_ut_steps": 4,
    "transformers_version": "4.55.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 49152,
}
# What the tests change: sizes that cost CPU time and nothing the engine's defaults depend on.
SCALED_DOWN = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["full_attention"] * 2,
    "vocab_size": 512,
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINKING_TOKENS = ("<think>", "</think>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking %}{{ '<think>\\n' }}{% endif %}"
    "{% endif %}"
)
ANSWER = "Hello"
_CORPUS = ["Hello world. Hello there! def hello(name):\n    return 'Hello ' + name\n"] * 50


def write_ouro_like_checkpoint(
    directory: Path, full_size: bool = False, closes_thinking: bool = False
) -> Path:
    """The checkpoint described in the module docstring, in `directory`.

    `full_size`: Ouro-1.4B's sizes unchanged (2.9 GB of bf16 weights; the H200 start-up check
    `python -m tests.real_ouro DIR`), with the same scripted weights and small tokenizer.
    `closes_thinking`: `<think>` and `</think>` are tokens of the vocabulary (added, not special,
    as in Qwen3-style tokenizers) and the answer is followed by `</think>` instead of
    <|im_end|>, so a reply is "Hello</think>Hello</think>..." until something constrains it."""
    raw = OURO_1_4B_CONFIG if full_size else OURO_1_4B_CONFIG | SCALED_DOWN
    thinking = THINKING_TOKENS if closes_thinking else ()
    answer_id = write_chat_tokenizer(directory, eos_token="<|endoftext|>", added=thinking)
    after_answer = 2  # <|im_end|>
    if closes_thinking:
        tokenizer = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        after_answer = int(tokenizer.token_to_id(THINKING_TOKENS[1]))
    config = OuroConfig.from_dict(raw)
    write_checkpoint(directory, config, scripted_weights(config, answer_id, after_answer))
    # Written over what write_checkpoint wrote: the exact published keys and values.
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    generation = {"bos_token_id": 0, "eos_token_id": 0, "transformers_version": "4.55.0"}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def write_chat_tokenizer(directory: Path, eos_token: str, added: tuple[str, ...] = ()) -> int:
    """tokenizer.json (byte-level BPE, `SPECIAL_TOKENS` at ids 0, 1, 2, then `added` as added
    tokens that are not special) and tokenizer_config.json (the ChatML template) in `directory`;
    returns the answer's token id."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(SCALED_DOWN["vocab_size"])
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in added])
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|endoftext|>",
        "eos_token": eos_token,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 131072,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    answer_id = tokenizer.token_to_id(ANSWER)
    assert answer_id is not None, "the tokenizer must hold the answer as one token"
    return int(answer_id)


def _tokenizer(vocab_size: int) -> BackendTokenizer:
    tokenizer = BackendTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2]
    return tokenizer


def scripted_weights(
    config: LoopedConfig, answer_id: int, after_answer: int = 2
) -> dict[str, torch.Tensor]:
    """Any family's weights: layers that add nothing (zero output projections), an embedding
    that tells the answer token from every other, and an LM head that maps other -> answer ->
    `after_answer` (<|im_end|>)."""
    tensors = random_state_dict(config, seed=0, dtype=torch.float32)
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name].zero_()
    tensors["model.norm.weight"].fill_(1.0)
    embedding = torch.zeros(config.vocab_size, config.hidden_size)
    embedding[:, 0] = 1.0
    embedding[answer_id] = 0.0
    embedding[answer_id, 1] = 1.0
    head = torch.zeros(config.vocab_size, config.hidden_size)
    head[answer_id, 0] = 10.0  # any other token -> the answer (a logit of 80 after the norm)
    head[after_answer, 1] = 10.0  # the answer -> <|im_end|>
    tensors["model.embed_tokens.weight"] = embedding
    tensors["lm_head.weight"] = head
    return {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in tensors.items()}


if __name__ == "__main__":
    import sys

    print(write_ouro_like_checkpoint(Path(sys.argv[1]), full_size=True))
