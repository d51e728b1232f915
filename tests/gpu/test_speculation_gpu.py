"""Self-speculative decoding on a CUDA GPU: fp32 equals the serial reference; in bf16 with
`batch_invariant` speculative output equals plain decoding bit for bit (without it, the step's
row count changes which matmul kernels run, so near-ties may flip: the device script counts
them); graphs equal eager; steady-state steps do not synchronise.

Run on a GPU machine with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopserve.engine.engine import Engine
from loopserve.sampling_params import SamplingParams
from tests.gpu.test_engine_gpu import (
    bf16_engine,
    checkpoint,
    fp32_engine_equals_reference,
    mixed_params,
    prompts,
    run,
    steps_without_synchronising,
)

__all__ = ["checkpoint"]  # the fixture this module shares

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def speculative(k: int, d: int) -> dict[str, object]:
    config = {"num_speculative_tokens": k, "draft_loops": d, "disable_by_batch_size": None}
    return {"speculative_config": config}


@pytest.mark.parametrize(("mode", "k", "d"), [("ouro", 4, 1), ("trace", 2, 2), ("fixed", 8, 3)])
def test_fp32_speculation_equals_reference(checkpoint: Path, mode: str, k: int, d: int) -> None:
    engine = fp32_engine_equals_reference(checkpoint, "full", mode, "refill", **speculative(k, d))
    assert engine.stats().proposed_tokens > 0


def test_bf16_batch_invariant_speculation_equals_plain_decoding(checkpoint: Path) -> None:
    batch, params = prompts(24, seed=4), mixed_params(24, 0.6)
    plain = run(bf16_engine(checkpoint, batch_invariant=True), batch, params)
    engine = bf16_engine(checkpoint, batch_invariant=True, **speculative(4, 1))
    assert run(engine, batch, params) == plain
    assert engine.stats().proposed_tokens > 100


def test_bf16_speculation_graphs_equal_eager(checkpoint: Path) -> None:
    batch, params = prompts(24, seed=1), mixed_params(24, 0.6)
    options = speculative(4, 2)
    graphed = run(bf16_engine(checkpoint, cuda_graphs=True, **options), batch, params)
    eager = run(bf16_engine(checkpoint, cuda_graphs=False, **options), batch, params)
    synchronous = run(
        bf16_engine(checkpoint, cuda_graphs=True, async_scheduling=False, **options),
        batch,
        params,
    )
    assert graphed == eager == synchronous


def test_steady_state_speculating_steps_do_not_synchronise(checkpoint: Path) -> None:
    engine: Engine = bf16_engine(checkpoint, **speculative(4, 1))
    for prompt in prompts(8, seed=3):
        engine.add_request(
            prompt, SamplingParams(max_tokens=200, ignore_eos=True, exit_threshold=0.6)
        )
    # The speculating decode step's graphs (the plain step's are never used here).
    _, graphs = engine.runner.speculating  # type: ignore[attr-defined]
    steps_without_synchronising(engine, graphs, 30)
    while engine.has_unfinished_requests():
        engine.step()
