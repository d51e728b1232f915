"""The built-in model shipped in the package: complete, small, loadable, its own tokenizer, and
depth doing real work on held-out text (perplexity falls with every loop; the gate saves loops
cheaply)."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest
import torch

from loopserve.eval.perplexity import (
    CurvePoint,
    curve_settings,
    evaluate_setting,
    held_out_windows,
)
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


@pytest.fixture(scope="module")
def held_out_points() -> dict[str, CurvePoint]:
    """Fixed depths 1..4 and two exit thresholds on 4096 held-out tokens of this interpreter's
    stdlib (the files training held out), in windows of the trained length."""
    model = load_checkpoint(BUILTIN_MODEL_DIR, torch.float32, "cpu")
    tokenizer = Tokenizer.from_directory(BUILTIN_MODEL_DIR)
    assert tokenizer is not None
    windows = held_out_windows(tokenizer, 0, seq_len=512, max_tokens=4096)
    settings = curve_settings(model.config.num_loops, [0.7, 0.5], fixed_depths=True)
    points = [evaluate_setting(model, windows, setting, batch_size=8) for setting in settings]
    return {point.label: point for point in points}


def test_perplexity_falls_with_every_loop(held_out_points: dict[str, CurvePoint]) -> None:
    perplexities = [held_out_points[f"fixed depth {depth}"].perplexity for depth in range(1, 5)]
    assert all(deeper < shallower for shallower, deeper in pairwise(perplexities)), perplexities


def test_the_gate_saves_depth_cheaply(held_out_points: dict[str, CurvePoint]) -> None:
    full = held_out_points["fixed depth 4"]
    gated = [held_out_points["threshold 0.7"], held_out_points["threshold 0.5"]]
    cheap = [point for point in gated if point.perplexity <= 1.05 * full.perplexity]
    assert cheap, [(point.label, point.perplexity, full.perplexity) for point in gated]
    best = min(cheap, key=lambda point: point.mean_depth)
    assert best.mean_depth <= 3.6, best
    shares = [count / best.tokens for count in best.depth_histogram]
    assert sum(share >= 0.1 for share in shares) >= 2, shares  # a real spread of exit depths


def test_the_shipped_chat_template_is_the_one_training_writes() -> None:
    from loopserve.train.tokenizer_training import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE

    assert (BUILTIN_MODEL_DIR / CHAT_TEMPLATE_FILE).read_text() == CHAT_TEMPLATE
    tokenizer = Tokenizer.from_directory(BUILTIN_MODEL_DIR)
    assert tokenizer is not None and tokenizer.chat_template == CHAT_TEMPLATE
