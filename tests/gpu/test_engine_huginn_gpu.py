"""Huginn-0125 on a CUDA GPU: prelude and coda layers with their own K/V, input injection, the
seeded initial state and convergence exits exact against the serial reference in fp32 (head_dim
96, the released 2-4-2 split at a small width); graphs equal eager in bf16 and a request alone
equals it inside a batch.

Run on a GPU machine with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopserve.models.checkpoint_writer import RandomInit, write_random_checkpoint
from loopserve.models.families import preset_config
from loopserve.reference import SerialReference
from tests.gpu.test_engine_gpu import mixed_params, prompts, run
from tests.gpu.test_engine_nanbeige_gpu import engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Huginn's head size and stage split at a small width, 6 loops.
SHAPE = {
    "vocab_size": 1024,
    "padded_vocab_size": 1024,
    "n_embd": 384,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 96,
    "intermediate_size": 768,
    "n_layers": 8,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "mean_recurrence": 6,
    "init_values": {"embed_scale": 384**0.5, "std": (2 / (5 * 384)) ** 0.5},
    "eos_token_id": None,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = preset_config("huginn-tiny", SHAPE)
    # Half-size weights: these states converge (their change falls from ~1.2 to ~0.3 of their
    # norm over 6 loops), so a threshold of 0.5 spreads the exits.
    directory = tmp_path_factory.mktemp("gpu-huginn")
    return write_random_checkpoint(directory, config, seed=5, init=RandomInit(weight_scale=0.5))


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize(
    ("exit_mode", "threshold", "criterion"),
    [
        ("ouro", 1.0, ""),
        ("ouro", 0.5, ""),
        ("trace", 1.0, ""),
        ("ouro", 0.3, "entropy-diff"),
        ("ouro", 0.9, "kl"),
    ],
)
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_fp32_engine_equals_reference(
    checkpoint: Path, layout: str, exit_mode: str, threshold: float, criterion: str, scheduling: str
) -> None:
    fp32 = engine(
        checkpoint,
        "float32",
        kv_layout=layout,
        exit_mode=exit_mode,
        scheduling=scheduling,
        exit_criterion=criterion,
    )
    batch, params = prompts(10), mixed_params(10, threshold)
    results = run(fp32, batch, params)
    reference = SerialReference(
        fp32.runner.model,  # type: ignore[attr-defined]
        kv_layout=layout,
        exit_mode=exit_mode,
        trace_distribution=fp32.runner.decode.trace_distribution,  # type: ignore[attr-defined]
    )
    for index, (prompt, request_params) in enumerate(zip(batch, params, strict=True)):
        expected = reference.generate(prompt, fp32.resolve(request_params))
        assert results[index] == (expected.token_ids, expected.exit_depths), f"request {index}"


@pytest.mark.parametrize(
    ("exit_mode", "threshold", "criterion"),
    [("ouro", 0.5, ""), ("trace", 1.0, ""), ("ouro", 0.9, "kl")],
)
def test_bf16_graphs_equal_eager(
    checkpoint: Path, exit_mode: str, threshold: float, criterion: str
) -> None:
    batch, params = prompts(24, seed=1), mixed_params(24, threshold)
    options = {"exit_mode": exit_mode, "exit_criterion": criterion}
    graphed = run(engine(checkpoint, "bfloat16", **options), batch, params)
    eager = run(engine(checkpoint, "bfloat16", cuda_graphs=False, **options), batch, params)
    assert graphed == eager
    assert len({d for _, depths in graphed for d in depths[1:]}) > 1  # depths really vary


def test_bf16_request_alone_equals_inside_a_batch_of_32(checkpoint: Path) -> None:
    batch, params = prompts(32, seed=2), mixed_params(32, 0.5)
    together = run(engine(checkpoint, "bfloat16", kv_layout="shared"), batch, params)
    for index in (0, 7, 31):
        alone = run(
            engine(checkpoint, "bfloat16", kv_layout="shared"), [batch[index]], [params[index]]
        )
        assert alone[0] == together[index], f"request {index} changed with its batch"
