"""The serial reference itself: at fixed depth with the `full` layout it is the plain model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.models.huginn import HuginnForCausalLM
from loopserve.models.looped import PROMPT_STATE_SEED
from loopserve.reference import SerialReference, dense_logits
from loopserve.sampling_params import SamplingParams


def test_fixed_depth_full_layout_matches_cache_free_recompute(tiny_checkpoint: Path) -> None:
    engine = Engine(EngineConfig.from_options(model=str(tiny_checkpoint), num_kv_pages=8))
    model = engine.runner.model
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    params = engine.resolve(SamplingParams(max_tokens=10, temperature=0.0, exit_threshold=1.0))
    out = SerialReference(model, kv_layout="full").generate(prompt, params)
    assert out.exit_depths == [4] * 10
    sequence = prompt + out.token_ids
    dense = dense_logits(model, sequence[:-1], num_loops=4)  # [N - 1, V]
    produced = dense[len(prompt) - 1 :]
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, produced[step], rtol=1e-5, atol=1e-5)
        assert int(produced[step].argmax()) == out.token_ids[step]


def test_teacher_forcing_returns_the_forced_tokens(tiny_checkpoint: Path) -> None:
    engine = Engine(EngineConfig.from_options(model=str(tiny_checkpoint), num_kv_pages=8))
    params = engine.resolve(SamplingParams(max_tokens=3, temperature=0.0, exit_threshold=0.6))
    forced = [10, 20, 30, 40, 50]
    out = SerialReference(engine.runner.model).generate([1, 2, 3], params, forced_tokens=forced)
    assert out.token_ids == forced and len(out.exit_depths) == 5 and len(out.logits) == 5
    assert out.finish_reason == "length"


@pytest.mark.parametrize(
    ("preset", "overrides"),
    [
        ("tiny", {}),
        ("tiny", {"tie_word_embeddings": True, "total_ut_steps": 3}),
        ("nanbeige-tiny", {}),
        ("nanbeige-tiny", {"num_loops": 3, "skip_loop_final_norm": True}),
        ("huginn-tiny", {}),
        ("huginn-tiny", {"qk_bias": False, "tie_embeddings": False, "mean_recurrence": 3}),
        (
            "huginn-tiny",
            {
                "n_layers": 8,
                "n_layers_in_prelude": 2,
                "n_layers_in_recurrent_block": 4,
                "n_layers_in_coda": 2,
            },
        ),
    ],
)
def test_every_family_computes_its_spec(preset: str, overrides: dict[str, object]) -> None:
    """The model's staged forward (what the engine and the serial reference run) equals the
    family's math written from docs/looped-models.md alone, at every depth."""
    from loopserve.models.checkpoint_writer import random_state_dict
    from loopserve.models.families import preset_config
    from loopserve.models.loader import build_model
    from loopserve.reference import dense_logits
    from loopserve.reference_spec import spec_logits

    config = preset_config(preset, overrides)
    weights = random_state_dict(config, seed=3)
    model = build_model(config)
    stored = {name: model.load_transform(name, tensor) for name, tensor in weights.items()}
    model.load_state_dict(stored, strict=not config.tie_word_embeddings)
    model.tie_weights()
    tokens = [5, 9, 17, 3, 200, 41, 8]
    positions = torch.arange(len(tokens))
    state = None
    if isinstance(model, HuginnForCausalLM):  # the seeded draw of prompt tokens
        state = model.initial_state(torch.full_like(positions, PROMPT_STATE_SEED), positions)
    for depth in range(1, config.num_loops + 1):
        expected = spec_logits(config, weights, tokens, depth, state)
        # Huginn: q and k are summed in another order (rotate-half layout), a few ulps apart.
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if state is not None else {}
        torch.testing.assert_close(dense_logits(model.eval(), tokens, depth), expected, **tolerance)
