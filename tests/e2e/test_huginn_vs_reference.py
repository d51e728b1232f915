"""Huginn-0125's engine token ids and exit depths equal the serial reference (fp32, CPU): prelude
and coda layers with K/V of their own, input injection, a seeded random initial state and the
convergence exit rule (latent-diff, and the criteria that read every loop's logits), across both
layouts, every exit mode, both scheduling modes, batch compositions with staggered arrivals,
prefill chunk sizes, 1, 3 and 8 loops and the 1-1-1 and 2-4-2 stage splits; with preemption,
prefix-cache hits and reserved allocation."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from loopserve.config import EngineConfig
from loopserve.depth.trace import D2_6
from loopserve.engine.engine import Engine
from loopserve.models.checkpoint_writer import write_random_checkpoint
from loopserve.models.families import preset_config
from loopserve.reference import SerialReference
from tests.e2e.test_engine_vs_reference import (
    PREFIXED,
    PROMPTS,
    RUN_STATS,
    params_for,
    run_engine,
)
from tests.pressure import PREEMPTING

# name -> (prelude, block, coda layers, loops, the convergence threshold that spreads the depths
# of these random weights: their states change by 0.3-1.3 of their norm a loop).
CHECKPOINTS = {
    "111x3": (1, 1, 1, 3, 0.95),
    "242x8": (2, 4, 2, 8, 0.7),
    "111x1": (1, 1, 1, 1, 0.95),
}
LAYOUTS, SCHEDULINGS = ("full", "shared"), ("refill", "no_refill")
MODE_NAMES = ("fixed", "converge", "converge_delayed", "trace")


def modes(name: str) -> dict[str, tuple[str, float]]:
    """Engine exit mode and request threshold of each mode name, for checkpoint `name`."""
    threshold = CHECKPOINTS[name][4]
    return {
        "fixed": ("ouro", 1.0),
        "converge": ("ouro", threshold),
        "converge_delayed": ("ouro_delayed", threshold),
        "trace": ("trace", 1.0),
    }


@pytest.fixture(scope="module")
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    name = request.param
    prelude, block, coda, loops, _ = CHECKPOINTS[name]
    fields = {
        "n_layers": prelude + block + coda,
        "n_layers_in_prelude": prelude,
        "n_layers_in_recurrent_block": block,
        "n_layers_in_coda": coda,
        "mean_recurrence": loops,
        "eos_token_id": None,
    }
    directory = tmp_path_factory.mktemp(f"huginn-{name}")
    return name, write_random_checkpoint(directory, preset_config("huginn-tiny", fields), seed=3)


@pytest.fixture(scope="module")
def reference(checkpoint: tuple[str, Path]):  # type: ignore[no-untyped-def]
    name, directory = checkpoint
    engine = Engine(EngineConfig.from_options(model=str(directory), num_kv_pages=8))
    loops = engine.model_config.num_loops

    @cache
    def run(
        layout: str, mode: str, index: int, prompt: tuple[int, ...] | None = None
    ) -> tuple[list[int], list[int]]:
        serial = SerialReference(
            engine.runner.model,  # type: ignore[attr-defined]
            kv_layout=layout,
            exit_mode=modes(name)[mode][0],
            trace_distribution=D2_6[:loops],
        )
        tokens = PROMPTS[index] if prompt is None else list(prompt)
        params = engine.resolve(params_for(index, mode, loops, modes(name)))
        out = serial.generate(tokens, params)
        return out.token_ids, out.exit_depths

    return run


CASES = (
    [
        ("111x3", layout, mode, scheduling, count, chunk)
        for layout in LAYOUTS
        for mode in MODE_NAMES
        for scheduling in SCHEDULINGS
        for count in (1, 8)
        for chunk in (1, 5, 128)
    ]
    + [
        ("242x8", layout, mode, scheduling, 8, 5)
        for layout in LAYOUTS
        for mode in MODE_NAMES
        for scheduling in SCHEDULINGS
    ]
    + [
        ("111x1", layout, "fixed", scheduling, 8, 5)
        for layout in LAYOUTS
        for scheduling in SCHEDULINGS
    ]
)


@pytest.mark.parametrize(
    ("checkpoint", "layout", "mode", "scheduling", "count", "chunk"), CASES, indirect=["checkpoint"]
)
def test_engine_equals_serial_reference(
    checkpoint: tuple[str, Path],
    reference,
    layout: str,
    mode: str,
    scheduling: str,
    count: int,
    chunk: int,
) -> None:  # type: ignore[no-untyped-def]
    name, directory = checkpoint
    results = run_engine(directory, layout, mode, scheduling, count, chunk, modes=modes(name))
    for index in range(count):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"


# Criteria that read each loop's logits -> a threshold that spreads these weights' exits.
LOGIT_CRITERIA = {"entropy-diff": 0.2, "kl": 0.9, "minp-kl": 0.5}


@pytest.mark.parametrize("checkpoint", ["111x3"], indirect=True)
@pytest.mark.parametrize("criterion", list(LOGIT_CRITERIA))
@pytest.mark.parametrize("scheduling", SCHEDULINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logit_criteria_equal_the_reference(
    checkpoint: tuple[str, Path], layout: str, scheduling: str, criterion: str
) -> None:
    """The engine's readout every loop (coda K/V rewritten until the exit) and the criterion's
    memory equal the reference's, and the exits really spread."""
    _, directory = checkpoint
    given = {"converge": ("ouro", LOGIT_CRITERIA[criterion])}
    options = {"exit_criterion": criterion}
    results = run_engine(directory, layout, "converge", scheduling, 8, 5, modes=given, **options)
    config = EngineConfig.from_options(model=str(directory), num_kv_pages=8, **options)
    engine = Engine(config)
    serial = SerialReference(engine.runner.model, kv_layout=layout)  # type: ignore[attr-defined]
    depths = []
    for index in range(8):
        params = engine.resolve(params_for(index, "converge", 3, given))
        out = serial.generate(PROMPTS[index], params)
        assert results[str(index)] == (out.token_ids, out.exit_depths), f"request {index}"
        depths += out.exit_depths[1:]
    assert len(set(depths)) >= 2, depths


def test_criteria_are_checked_against_the_family() -> None:
    from loopserve.models.model_config import ConfigError

    config = preset_config("huginn-tiny")
    assert config.resolve_exit_criterion("") == "latent-diff"
    with pytest.raises(ConfigError, match="'argmax-stability' is not one of huginn's"):
        config.resolve_exit_criterion("argmax-stability")
    with pytest.raises(ConfigError, match=r"'kl' is not one of nanbeige's .*no exit rule"):
        preset_config("nanbeige-tiny").resolve_exit_criterion("kl")
    assert preset_config("tiny").resolve_exit_criterion("") == "gate"


@pytest.mark.parametrize("checkpoint", ["111x3", "242x8"], indirect=True)
@pytest.mark.parametrize("mode", ["converge", "converge_delayed", "trace"])
def test_adaptive_modes_really_vary_the_depth(reference, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Guards the matrix against passing vacuously at one depth: convergence exits happen."""
    depths = [d for index in range(len(PROMPTS)) for d in reference("full", mode, index)[1][1:]]
    assert len(set(depths)) >= 2, depths


@pytest.mark.parametrize("checkpoint", ["111x3"], indirect=True)
@pytest.mark.parametrize("mode", ["fixed", "converge"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_preempted_prefixed_and_reserved_runs_equal_the_reference(
    checkpoint: tuple[str, Path], reference, layout: str, mode: str
) -> None:  # type: ignore[no-untyped-def]
    """Swapped out and back in (a small cache), prefix-cache hits (the prompt's initial states
    do not depend on the request), and the worst-case reservation without a prefix cache."""
    name, directory = checkpoint
    given = modes(name)
    pages = 16 if layout == "full" else 11
    results = run_engine(
        directory, layout, mode, "refill", 8, 5, modes=given, num_kv_pages=pages, **PREEMPTING
    )
    assert RUN_STATS[directory, layout, mode, "refill", 8, 5].num_preemptions > 0
    for index in range(8):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"
    results = run_engine(directory, layout, mode, "refill", 6, 7, prompts=PREFIXED, modes=given)
    assert RUN_STATS[directory, layout, mode, "refill", 6, 7].prefix_cache_hit_rate > 0.3
    for index, prompt in enumerate(PREFIXED):
        assert results[str(index)] == reference(layout, mode, index, tuple(prompt))
    results = run_engine(
        directory,
        layout,
        mode,
        "refill",
        8,
        5,
        modes=given,
        kv_allocation="reserve",
        prefix_caching=False,
    )
    for index in range(8):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"
