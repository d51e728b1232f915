"""Engine token ids and exit depths equal the serial reference (fp32, CPU) across layouts, exit
modes, scheduling modes, batch compositions with staggered arrivals, and prefill chunk sizes."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.reference import SerialReference
from loopserve.sampling_params import SamplingParams

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


def params_for(index: int, mode: str) -> SamplingParams:
    min_loops, max_loops = LOOP_RANGES[index]
    return SamplingParams(
        max_tokens=6 + index % 4,
        temperature=0.0,
        seed=1000 + index,
        min_loops=min_loops,
        max_loops=max_loops,
        exit_threshold=MODES[mode][1],
    )


def run_engine(
    checkpoint: Path,
    layout: str,
    mode: str,
    scheduling: str,
    count: int,
    chunk: int,
    **options: object,
) -> dict[str, tuple[list[int], list[int]]]:
    engine = Engine(
        EngineConfig(
            model=str(checkpoint),
            kv_layout=layout,
            exit_mode=MODES[mode][0],
            scheduling=scheduling,
            prefill_chunk_size=chunk,
            max_num_batched_tokens=max(chunk, 16),
            max_num_seqs=8,
            num_kv_pages=256,
            **options,  # type: ignore[arg-type]
        )
    )
    results: dict[str, tuple[list[int], list[int]]] = {}
    step = 0
    while len(results) < count:
        if step % 2 == 0 and step // 2 < count:  # staggered arrivals: one every other step
            index = step // 2
            engine.add_request(PROMPTS[index], params_for(index, mode), request_id=str(index))
        for output in engine.step():
            if output.finished:
                results[output.request_id] = (output.token_ids, output.exit_depths)
        step += 1
    assert engine.stats().kv_pages_used == 0
    return results


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    engine = Engine(EngineConfig(model=str(tiny_checkpoint), num_kv_pages=8))

    @cache
    def run(layout: str, mode: str, index: int) -> tuple[list[int], list[int]]:
        serial = SerialReference(engine.runner.model, kv_layout=layout, exit_mode=MODES[mode][0])
        out = serial.generate(PROMPTS[index], engine.resolve(params_for(index, mode)))
        return out.token_ids, out.exit_depths

    return run


@pytest.mark.parametrize("chunk", [1, 5, 128])
@pytest.mark.parametrize("count", [1, 3, 8])
@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_engine_equals_serial_reference(
    tiny_checkpoint: Path,
    reference,
    layout: str,
    mode: str,
    scheduling: str,
    count: int,
    chunk: int,
) -> None:  # type: ignore[no-untyped-def]
    results = run_engine(tiny_checkpoint, layout, mode, scheduling, count, chunk)
    for index in range(count):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_device_resident_decode_equals_serial_reference(
    tiny_checkpoint: Path,
    reference,
    layout: str,
    mode: str,
    scheduling: str,
    async_scheduling: bool,
) -> None:  # type: ignore[no-untyped-def]
    """The decode step that keeps per-slot state on the device (the GPU path, run eagerly here)."""
    results = run_engine(
        tiny_checkpoint, layout, mode, scheduling, len(PROMPTS), 5,
        decode_mode="device", async_scheduling=async_scheduling,
    )  # fmt: skip
    for index in range(len(PROMPTS)):
        assert results[str(index)] == reference(layout, mode, index), f"request {index}"


@pytest.mark.parametrize("mode", ["ouro", "ouro_delayed", "trace"])
def test_adaptive_modes_really_vary_the_depth(reference, mode: str) -> None:  # type: ignore[no-untyped-def]
    """Guards the matrix above against passing vacuously at a single depth."""
    depths = [d for index in range(len(PROMPTS)) for d in reference("full", mode, index)[1][1:]]
    assert len(set(depths)) >= 2, depths
    assert sum(depths) / len(depths) < 3.6
