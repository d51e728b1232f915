"""Nanbeige4.2 on a CUDA GPU: the fused pre-norm layers and GQA 6:1 attention exact against the
serial reference in fp32, graphs equal eager in bf16, a request alone equals it inside a batch.

Run on a GPU machine with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.models.checkpoint_writer import write_random_checkpoint
from loopserve.models.families import preset_config
from loopserve.reference import SerialReference
from loopserve.sampling_params import SamplingParams
from tests.gpu.test_engine_gpu import prompts, run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Nanbeige's head ratio (6 query heads per KV head, head_dim 128 > hidden / heads) at a small size.
SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 384,
    "intermediate_size": 768,
    "num_hidden_layers": 3,
    "num_attention_heads": 6,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "kv_channels": 128,
    "max_position_embeddings": 2048,
    "eos_token_id": None,
}
# Checkpoints: name -> config.json fields besides SHAPE.
VARIANTS = {
    "two_loops": {},
    "three_loops_skip_norm": {"num_loops": 3, "skip_loop_final_norm": True},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = preset_config("nanbeige-tiny", SHAPE | VARIANTS[request.param])
    return write_random_checkpoint(tmp_path_factory.mktemp(f"gpu-{request.param}"), config)


def traced_params(count: int) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=24 + 5 * (i % 4),
            temperature=0.0 if i % 2 else 0.9,
            top_p=0.95,
            seed=100 + i,
            ignore_eos=True,
        )
        for i in range(count)
    ]


def engine(checkpoint: Path, dtype: str, **options: object) -> Engine:
    settings = {"max_num_seqs": 32, "num_kv_pages": 4096, "prefill_chunk_size": 64}
    return Engine(
        EngineConfig.from_options(
            model=str(checkpoint), device="cuda", dtype=dtype, attention_backend="triton",
            **(settings | options),
        )
    )  # fmt: skip


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("exit_mode", ["ouro", "trace"])  # "ouro" without a gate: fixed depth
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_fp32_engine_equals_reference(
    checkpoint: Path, layout: str, exit_mode: str, scheduling: str
) -> None:
    fp32 = engine(
        checkpoint, "float32", kv_layout=layout, exit_mode=exit_mode, scheduling=scheduling
    )
    batch, params = prompts(10), traced_params(10)
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


def test_bf16_graphs_equal_eager(checkpoint: Path) -> None:
    batch, params = prompts(24, seed=1), traced_params(24)
    graphed = run(engine(checkpoint, "bfloat16", exit_mode="trace"), batch, params)
    eager = run(engine(checkpoint, "bfloat16", exit_mode="trace", cuda_graphs=False), batch, params)
    assert graphed == eager
    assert len({d for _, depths in graphed for d in depths[1:]}) > 1  # depths really vary


def test_bf16_request_alone_equals_inside_a_batch_of_32(checkpoint: Path) -> None:
    batch, params = prompts(32, seed=2), traced_params(32)
    together = run(engine(checkpoint, "bfloat16", exit_mode="trace"), batch, params)
    for index in (0, 7, 31):
        alone = run(
            engine(checkpoint, "bfloat16", exit_mode="trace"), [batch[index]], [params[index]]
        )
        assert alone[0] == together[index], f"request {index} changed with its batch"
