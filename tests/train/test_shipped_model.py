"""The built-in model shipped in the package: complete, small, loadable, and its own tokenizer."""

from __future__ import annotations

import json

import torch

from loopserve.models.builtin import BUILTIN_MODEL_DIR
from loopserve.models.loader import load_checkpoint
from loopserve.tokenizer import Tokenizer

SIZE_LIMIT = 10 * 2**20


def test_the_assets_are_complete_and_small() -> None:
    names = {path.name for path in BUILTIN_MODEL_DIR.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    total = sum(path.stat().st_size for path in BUILTIN_MODEL_DIR.iterdir())
    assert total <= SIZE_LIMIT, f"{total / 2**20:.1f} MB"


def test_the_config_is_a_looped_ouro_model() -> None:
    config = json.loads((BUILTIN_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "ouro"
    assert config["total_ut_steps"] == 4
    assert config["max_position_embeddings"] >= 2048


def test_it_loads_with_its_tokenizer() -> None:
    model = load_checkpoint(BUILTIN_MODEL_DIR, torch.float32, "cpu")
    tokenizer = Tokenizer.from_directory(BUILTIN_MODEL_DIR)
    assert tokenizer is not None
    assert tokenizer.vocab_size == model.config.vocab_size
    assert tokenizer.token_to_id("<|endoftext|>") == 0 == model.config.bos_token_id
    assert model.config.eos_token_ids == (0,)
    code = 'def greet(name: str) -> str:\n    return f"Hello, {name}!"\n'
    assert tokenizer.decode(tokenizer.encode(code)) == code
    assert len(tokenizer.encode(code)) < len(code) / 2  # BPE merges, not bytes
