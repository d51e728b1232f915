"""Engine token ids and exit depths equal the serial reference (fp32, CPU) across families, layouts,
exit modes, scheduling modes, batch compositions with staggered arrivals, prefill chunk sizes, and
models with 4, 3 and 2 loops: Ouro (every exit mode) and Nanbeige4.2 (fixed depth and traces; GQA
6:1, with the final norm between loops and without)."""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

import pytest

from loopserve.config import EngineConfig
from loopserve.depth.trace import D2_6
from loopserve.engine.engine import Engine
from loopserve.engine.stats import EngineStats
from loopserve.models.checkpoint_writer import write_random_checkpoint
from loopserve.models.families import preset_config, read_model_config
from loopserve.reference import SerialReference
from loopserve.sampling_params import SamplingParams
from tests.conftest import TINY_CONFIG, VARIED_GATE
from tests.pressure import PREEMPTING

PROMPTS = [
    [7, 3, 9, 120, 44, 2, 18, 99, 5, 61, 17],
    [200],
    list(range(30, 70)),
    [5, 5, 5, 5, 81],
    [11, 250, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
    [90, 91],
    list(range(100, 133)),
    [42, 43, 44, 45, 46, 47, 48],
]
# Some requests use their own loop range, so per-request planes and prompt loops are exercised.
LOOP_RANGES = [(1, None), (1, None), (2, None), (1, 3), (1, None), (1, 2), (1, None), (2, 4)]
MODES = {  # name -> (engine exit mode, exit threshold)
    "fixed": ("ouro", 1.0),
    "ouro": ("ouro", 0.6),
    "ouro_delayed": ("ouro_delayed", 0.6),
    "trace": ("trace", 1.0),
}


def params_for(
    index: int, mode: str, num_loops: int, modes: dict[str, tuple[str, float]] = MODES
) -> SamplingParams:
    min_loops, max_loops = LOOP_RANGES[index]
    return SamplingParams(
        max_tokens=6 + index % 4,
        temperature=0.0,
        seed=1000 + index,
        min_loops=min(min_loops, num_loops),
        max_loops=None if max_loops is None else min(max_loops, num_loops),
        exit_threshold=modes[mode][1],
    )


def run_engine(
    checkpoint: Path,
    layout: str,
    mode: str,
    scheduling: str,
    count: int,
    chunk: int,
    prompts: list[list[int]] = PROMPTS,
    modes: dict[str, tuple[str, float]] = MODES,
    **options: object,
) -> dict[str, tuple[list[int], list[int]]]:
    settings: dict[str, object] = {
        "model": str(checkpoint),
        "kv_layout": layout,
        "exit_mode": modes[mode][0],
        "scheduling": scheduling,
        "prefill_chunk_size": chunk,
        "max_num_batched_tokens": max(chunk, 16),
        "max_num_seqs": 8,
        "num_kv_pages": 256,
        "trace_distribution": D2_6[: engine_loops(checkpoint)],
    }
    engine = Engine(EngineConfig.from_options(**(settings | options)))
    loops = engine.model_config.num_loops
    results: dict[str, tuple[list[int], list[int]]] = {}
    step = 0
    while len(results) < count:
        if step % 2 == 0 and step // 2 < count:  # staggered arrivals: one every other step
            index = step // 2
            engine.add_request(
                prompts[index], params_for(index, mode, loops, modes), request_id=str(index)
            )
        for output in engine.step():
            if output.finished:
                sequence = output.outputs[0]
                results[output.request_id] = (sequence.token_ids, sequence.exit_depths)
        step += 1
    stats = engine.stats()
    assert stats.kv_pages_used == 0
    RUN_STATS[checkpoint, layout, mode, scheduling, count, chunk] = stats
    return results


# The statistics of each run_engine call, for the guards that preemption and prefix hits happened.
RUN_STATS: dict[tuple[object, ...], EngineStats] = {}


def engine_loops(checkpoint: Path) -> int:
    return read_model_config(checkpoint / "config.json").num_loops


# Tiny Nanbeige checkpoints: name -> config.json fields changed from the nanbeige-tiny preset.
NANBEIGE = {
    "nanbeige": {},
    "nanbeige-3-skip": {"num_loops": 3, "skip_loop_final_norm": True},
}
# The exit modes a family has (Nanbeige has no gate).
NANBEIGE_MODES = ("fixed", "trace")


@pytest.fixture(scope="module")
def checkpoint(request, tiny_checkpoint: Path, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """The parameter: the tiny random Ouro checkpoint's loop count (4, or the same shapes with
    fewer), or the name of a tiny Nanbeige checkpoint (`NANBEIGE`)."""
    param = getattr(request, "param", 4)
    if param == 4:
        return tiny_checkpoint
    directory = tmp_path_factory.mktemp(f"tiny-{param}")
    if isinstance(param, str):
        config = preset_config("nanbeige-tiny", NANBEIGE[param] | {"eos_token_id": None})
        return write_random_checkpoint(directory, config, seed=len(param))
    config = dataclasses.replace(TINY_CONFIG, num_loops=param)
    return write_random_checkpoint(directory, config, seed=param, init=VARIED_GATE)


LAYOUTS, SCHEDULINGS = ("full", "shared"), ("refill", "no_refill")
# Every combination on the 4-loop checkpoint; 8 staggered requests in chunks of 5 with 3 and 2.
CASES = (
    [
        (4, layout, mode, scheduling, count, chunk)
        for layout in LAYOUTS
        for mode in MODES
        for scheduling in SCHEDULINGS
        for count in (1, 3, 8)
        for chunk in (1, 5, 128)
    ]
    + [
        (loops, layout, mode, scheduling, 8, 5)
        for loops in (3, 2)
        for layout in LAYOUTS
        for mode in MODES
        for scheduling in SCHEDULINGS
    ]
    + [
        ("nanbeige", layout, mode, scheduling, count, chunk)
        for layout in LAYOUTS
        for mode in NANBEIGE_MODES
        for scheduling in SCHEDULINGS
        for count in (1, 8)
        for chunk in (1, 5, 128)
    ]
    + [
        ("nanbeige-3-skip", layout, mode, scheduling, 8, 5)
        for layout in LAYOUTS
        for mode in NANBEIGE_MODES
        for scheduling in SCHEDULINGS
    ]
)
# Every exit mode of each family, for the tests that run one checkpoint per family.
FAMILY_MODES = [(4, mode) for mode in MODES] + [("nanbeige", mode) for mode in NANBEIGE_MODES]


@pytest.fixture(scope="module")
def reference(checkpoint: Path):  # type: ignore[no-untyped-def]
    engine = Engine(EngineConfig.from_options(model=str(checkpoint), num_kv_pages=8))
    loops = engine.model_config.num_loops
    distribution = D2_6[:loops]

    @cache
    def run(
        layout: str, mode: str, index: int, prompt: tuple[int, ...] | None = None
    ) -> tuple[list[int], list[int]]:
        serial = SerialReference(
            engine.runner.model,  # type: ignore[attr-defined]
            kv_layout=layout,
            exit_mode=MODES[mode][0],
            trace_distribution=distribution,
        )
        tokens = PROMPTS[index] if prompt is None else list(prompt)
        out = serial.generate(tokens, engine.resolve(params_for(index, mode, loops)))
        return out.token_ids, out.exit_depths

    return run


@pytest.mark.parametrize(
    ("checkpoint", "layout", "mode", "scheduling", "count", "chunk"),
    CASES,
    indirect=["checkpoint"],
)
def test_engine_equals_serial_reference(
    checkpoint: Path,
    reference,
    layout: str,
    mode: str,
    scheduling: str,
    count: int,
    chunk: int,
) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(checkpoint, layout, mode, scheduling, count, chunk)
    for index in range(count):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize(("checkpoint", "mode"), FAMILY_MODES, indirect=["checkpoint"])
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_synchronous_scheduling_equals_serial_reference(
    checkpoint: Path, reference, layout: str, mode: str, scheduling: str
) -> None:  # type: ignore[no-untyped-def]
    """Each step read back before the next is launched (the results do not depend on it)."""
    results = run_engine(
        checkpoint, layout, mode, scheduling, len(PROMPTS), 5, async_scheduling=False
    )
    for index in range(len(PROMPTS)):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"


@pytest.mark.parametrize(
    ("checkpoint", "mode"),
    [
        *[(4, "ouro"), (4, "ouro_delayed"), (4, "trace"), (3, "ouro"), (2, "ouro"), (2, "trace")],
        *[("nanbeige", "trace"), ("nanbeige-3-skip", "trace")],
    ],
    indirect=["checkpoint"],
)
def test_adaptive_modes_really_vary_the_depth(reference, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Guards the matrix above against passing vacuously at a single depth. (With 2 loops a
    delayed exit is always at loop 2: the test cannot hold before loop 1 ends.)"""
    depths = [d for index in range(len(PROMPTS)) for d in reference("full", mode, index)[1][1:]]
    assert len(set(depths)) >= 2, depths


@pytest.mark.parametrize(("checkpoint", "mode"), FAMILY_MODES, indirect=["checkpoint"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_preempted_requests_keep_every_token_and_depth(
    checkpoint: Path, reference, layout: str, mode: str
) -> None:  # type: ignore[no-untyped-def]
    """A small cache (20 pages with 4 loops, 8 with Nanbeige's 2): requests are swapped out and
    back in while they grow."""
    pages = 8 if engine_loops(checkpoint) == 2 else 20
    results = run_engine(checkpoint, layout, mode, "refill", 8, 5, num_kv_pages=pages, **PREEMPTING)
    assert RUN_STATS[checkpoint, layout, mode, "refill", 8, 5].num_preemptions > 0
    for index in range(8):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"


@pytest.mark.parametrize(("checkpoint", "mode"), FAMILY_MODES, indirect=["checkpoint"])
def test_recomputed_requests_keep_every_token_and_depth(
    checkpoint: Path, reference, mode: str
) -> None:  # type: ignore[no-untyped-def]
    """The same small cache with recompute preemption: a victim's pages are dropped and, admitted
    again, its prompt and generated tokens are prefilled again, each to its own exit depth."""
    pages = 8 if engine_loops(checkpoint) == 2 else 20
    results = run_engine(
        checkpoint,
        "full",
        mode,
        "refill",
        8,
        5,
        num_kv_pages=pages,
        preemption_mode="recompute",
        **PREEMPTING,
    )
    stats = RUN_STATS[checkpoint, "full", mode, "refill", 8, 5]
    assert stats.num_preemptions > 0 and stats.recomputed_tokens > 0
    for index in range(8):
        assert results[str(index)] == reference("full", mode, index), f"request {index}"


# Six prompts sharing 36 tokens (two full pages of 16), then their own.
SHARED_PREFIX = list(range(50, 86))
PREFIXED = [SHARED_PREFIX + prompt[: 3 + index] for index, prompt in enumerate(PROMPTS[:6])]


@pytest.mark.parametrize(("checkpoint", "mode"), FAMILY_MODES, indirect=["checkpoint"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_cache_hits_give_the_tokens_of_a_miss(
    checkpoint: Path, reference, layout: str, mode: str
) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(checkpoint, layout, mode, "refill", 6, 7, prompts=PREFIXED)
    assert RUN_STATS[checkpoint, layout, mode, "refill", 6, 7].prefix_cache_hit_rate > 0.3
    for index, prompt in enumerate(PREFIXED):
        expected = reference(layout, mode, index, tuple(prompt))
        assert results[str(index)] == expected, f"request {index}"


@pytest.mark.parametrize(
    ("checkpoint", "mode"), [(4, "ouro"), ("nanbeige", "fixed")], indirect=["checkpoint"]
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reserved_allocation_equals_serial_reference(
    checkpoint: Path, reference, layout: str, mode: str
) -> None:  # type: ignore[no-untyped-def]
    """The worst-case reservation mode, with the prefix cache off."""
    results = run_engine(
        checkpoint, layout, mode, "refill", 8, 5, kv_allocation="reserve", prefix_caching=False
    )
    for index in range(8):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"
