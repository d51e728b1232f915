"""FP8 weights (`quantization="fp8"`), the fp8 KV cache (with scale 1, and with per-layer scales
from `calculate_kv_scales`) and both together on the CPU (fp32 activations): the engine's token
ids and exit depths equal the serial reference that runs the same quantized model and keeps K/V
as the cache does, with the engine's scales. Across the families (Ouro with 4 and 2 loops,
Nanbeige4.2, Huginn-0125 with prelude and coda layers), both layouts, every exit mode, both
scheduling modes, staggered batches in prefill chunks, swap and recompute preemption and
prefix-cache hits; and each quantization really changes some tokens, so the equalities are not
those of the unquantized model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from loopserve.config import EngineConfig
from loopserve.depth.trace import D2_6
from loopserve.engine.engine import Engine
from loopserve.models.checkpoint_writer import write_random_checkpoint
from loopserve.models.families import preset_config
from loopserve.reference import SerialReference
from tests.conftest import TINY_CONFIG, VARIED_GATE
from tests.e2e.test_engine_vs_reference import MODES, PREFIXED, PROMPTS, RUN_STATS, params_for
from tests.e2e.test_engine_vs_reference import run_engine as run_engine_with
from tests.e2e.test_fp8_kv_cache import engine_kv_scales
from tests.e2e.test_huginn_vs_reference import modes as huginn_modes
from tests.pressure import PREEMPTING

QUANTIZED = {
    "fp8-weights": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "fp8-kv-scaled": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp8-both": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
# Family checkpoint -> its exit modes (name -> engine exit mode, request threshold).
FAMILIES: dict[str, dict[str, tuple[str, float]]] = {
    "ouro": MODES,
    "ouro-2": MODES,
    "nanbeige": {name: MODES[name] for name in ("fixed", "trace")},
    "huginn": huginn_modes("111x3"),
}
Run = tuple[list[int], list[int]]


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    @cache
    def get(name: str) -> Path:
        if name == "ouro":
            return tiny_checkpoint
        directory = tmp_path_factory.mktemp(name)
        if name == "ouro-2":
            config = dataclasses.replace(TINY_CONFIG, num_loops=2)
            return write_random_checkpoint(directory, config, seed=2, init=VARIED_GATE)
        if name == "nanbeige":
            config = preset_config("nanbeige-tiny", {"eos_token_id": None})
            return write_random_checkpoint(directory, config, seed=8)
        fields = {
            "n_layers": 3, "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 1,
            "n_layers_in_coda": 1, "mean_recurrence": 3, "eos_token_id": None,
        }  # fmt: skip
        return write_random_checkpoint(directory, preset_config("huginn-tiny", fields), seed=3)

    return get


@pytest.fixture(scope="module")
def reference(checkpoints):  # type: ignore[no-untyped-def]
    """(family, quantization or "none", layout, mode, request index[, prompt]) -> the serial
    reference's (tokens, depths) on that quantization's model."""
    engines: dict[tuple[str, str], Engine] = {}

    @cache
    def run(
        family: str,
        quantized: str,
        layout: str,
        mode: str,
        index: int,
        prompt: tuple[int, ...] = (),
    ) -> Run:
        options = QUANTIZED.get(quantized, {})
        key = (family, quantized)
        if key not in engines:
            config = EngineConfig.from_options(
                model=str(checkpoints(family)), num_kv_pages=8, **options
            )
            engines[key] = Engine(config)
        engine = engines[key]
        loops = engine.model_config.num_loops
        serial = SerialReference(
            engine.runner.model,  # type: ignore[attr-defined]
            kv_layout=layout,
            exit_mode=FAMILIES[family][mode][0],
            trace_distribution=D2_6[:loops],
            kv_cache_dtype=str(options.get("kv_cache_dtype", "auto")),
            kv_scales=engine_kv_scales(engine),
        )
        params = engine.resolve(params_for(index, mode, loops, FAMILIES[family]))
        out = serial.generate(list(prompt) or PROMPTS[index], params)
        return out.token_ids, out.exit_depths

    return run


def run_engine(
    checkpoints: Callable[[str], Path], family: str, quantized: str, layout: str, mode: str,
    scheduling: str = "refill", prompts: list[list[int]] = PROMPTS, chunk: int = 5,
    **options: object,
) -> dict[str, Run]:  # fmt: skip
    return run_engine_with(
        checkpoints(family), layout, mode, scheduling, len(prompts), chunk, prompts,
        FAMILIES[family], **QUANTIZED[quantized], **options,
    )  # fmt: skip


CASES = [
    (family, quantized, layout, mode, scheduling)
    for quantized in QUANTIZED
    for family, family_modes in FAMILIES.items()
    for layout in ("full", "shared")
    for mode in family_modes
    for scheduling in ("refill", "no_refill") if family == "ouro" or scheduling == "refill"
]  # fmt: skip


@pytest.mark.parametrize(("family", "quantized", "layout", "mode", "scheduling"), CASES)
def test_engine_equals_the_quantized_reference(
    checkpoints, reference, family: str, quantized: str, layout: str, mode: str, scheduling: str
) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(checkpoints, family, quantized, layout, mode, scheduling)
    for index in range(len(PROMPTS)):
        expected = reference(family, quantized, layout, mode, index)
        assert results[str(index)] == expected, f"request {index}"


@pytest.mark.parametrize("quantized", QUANTIZED)
@pytest.mark.parametrize("family", FAMILIES)
def test_quantization_changes_some_tokens(reference, family: str, quantized: str) -> None:
    """Otherwise the equalities above would hold for an engine that ignores the setting (and
    calculated scales change tokens against scale 1, so the engine cannot ignore them either)."""
    mode = "fixed"
    baselines = ("none", "fp8-kv") if quantized == "fp8-kv-scaled" else ("none",)
    runs = {
        name: [reference(family, name, "full", mode, index) for index in range(len(PROMPTS))]
        for name in (*baselines, quantized)
    }
    for baseline in baselines:
        assert runs[baseline] != runs[quantized], baseline


# Preemption (swap, recompute) and prefix-cache hits, with both quantizations on.
PRESSURE = [
    ("ouro", "ouro"), ("ouro", "trace"), ("nanbeige", "fixed"), ("huginn", "converge"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("family", "mode", "preemption_mode"),
    [
        (family, mode, preemption_mode)
        for family, mode in PRESSURE
        for preemption_mode in ("swap", "recompute")
        if family != "huginn" or preemption_mode == "swap"  # Huginn: recompute is refused
    ],
)
def test_preempted_requests_equal_the_quantized_reference(
    checkpoints, reference, family: str, mode: str, preemption_mode: str
) -> None:  # type: ignore[no-untyped-def]
    pages = 8 if family == "nanbeige" else 20
    results = run_engine(
        checkpoints, family, "fp8-both", "full", mode, num_kv_pages=pages,
        preemption_mode=preemption_mode, **PREEMPTING,
    )  # fmt: skip
    stats = RUN_STATS[checkpoints(family), "full", mode, "refill", len(PROMPTS), 5]
    assert stats.num_preemptions > 0
    for index in range(len(PROMPTS)):
        assert results[str(index)] == reference(family, "fp8-both", "full", mode, index)


@pytest.mark.parametrize(("family", "mode"), PRESSURE)
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_prefix_cache_hits_equal_the_quantized_reference(
    checkpoints, reference, family: str, mode: str, layout: str
) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(checkpoints, family, "fp8-both", layout, mode, prompts=PREFIXED, chunk=7)
    stats = RUN_STATS[checkpoints(family), layout, mode, "refill", len(PREFIXED), 7]
    assert stats.prefix_cache_hit_rate > 0.3
    for index, prompt in enumerate(PREFIXED):
        expected = reference(family, "fp8-both", layout, mode, index, tuple(prompt))
        assert results[str(index)] == expected, f"request {index}"
