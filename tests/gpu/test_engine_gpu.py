"""Engine on a CUDA GPU: exact against the serial reference in fp32, graphs equal eager in bf16,
batch invariance of the whole step, and no host synchronisation in steady-state steps.

Run on a GPU machine with `pytest -m gpu tests/gpu`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from loopserve.config import EngineConfig
from loopserve.engine.engine import Engine
from loopserve.models.checkpoint_writer import RandomInit, write_random_checkpoint
from loopserve.models.ouro_config import OuroConfig
from loopserve.reference import SerialReference
from loopserve.runner.cuda_graphs import GraphedDecodeStep
from loopserve.sampling_params import SamplingParams
from tests.e2e.test_fp8_kv_cache import engine_kv_scales
from tests.pressure import PREEMPTING

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# head_dim 64 and 128 are what the Triton kernels are built for; GQA 2:1.
GPU_CONFIG = OuroConfig(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    eos_token_ids=(),
)
MODES = {
    "fixed": ("ouro", 1.0),
    "ouro": ("ouro", 0.6),
    "delayed": ("ouro_delayed", 0.6),
    "trace": ("trace", 1.0),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gpu-ouro")
    return write_random_checkpoint(
        directory, GPU_CONFIG, init=RandomInit(gate_scale=4.0, gate_bias=-0.5)
    )


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (count,), generator=generator).tolist()
    return [torch.randint(0, 1024, (n,), generator=generator).tolist() for n in lengths]


def run(
    engine: Engine, batch: list[list[int]], params: list[SamplingParams]
) -> list[tuple[list[int], list[int]]]:
    ids = [engine.add_request(p, q) for p, q in zip(batch, params, strict=True)]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].exit_depths)
    assert engine.stats().kv_pages_used == 0
    return [done[i] for i in ids]


def mixed_params(count: int, threshold: float) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=24 + 5 * (i % 4),
            temperature=0.0 if i % 2 else 0.9,
            top_p=0.95,
            seed=100 + i,
            exit_threshold=threshold,
            ignore_eos=True,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("scheduling", ["refill", "no_refill"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_fp32_engine_equals_reference(
    checkpoint: Path, layout: str, mode: str, scheduling: str
) -> None:
    fp32_engine_equals_reference(checkpoint, layout, mode, scheduling)


@pytest.mark.parametrize("layout", ["full", "shared"])
def test_batch_invariant_fp32_engine_equals_reference(checkpoint: Path, layout: str) -> None:
    """The down projection and exit gate through kernels/matmul.py, in the model the reference
    runs too."""
    fp32_engine_equals_reference(checkpoint, layout, "ouro", "refill", batch_invariant=True)


def fp32_engine_equals_reference(
    checkpoint: Path, layout: str, mode: str, scheduling: str, **options: object
) -> Engine:
    """The engine's run of 10 mixed requests equals the serial reference (which keeps K/V as the
    engine's `kv_cache_dtype` option says, with the engine's fp8 scales); returns the engine."""
    exit_mode, threshold = MODES[mode]
    engine = Engine(
        EngineConfig.from_options(
            model=str(checkpoint), device="cuda", dtype="float32", kv_layout=layout,
            exit_mode=exit_mode, scheduling=scheduling, attention_backend="triton",
            max_num_seqs=16, num_kv_pages=2048, prefill_chunk_size=64,
            **options,
        )
    )  # fmt: skip
    batch, params = prompts(10), mixed_params(10, threshold)
    results = run(engine, batch, params)
    reference = SerialReference(
        engine.runner.model,  # type: ignore[attr-defined]
        kv_layout=layout,
        exit_mode=exit_mode,
        kv_cache_dtype=str(options.get("kv_cache_dtype", "auto")),
        kv_scales=engine_kv_scales(engine),
    )
    for index, (prompt, request_params) in enumerate(zip(batch, params, strict=True)):
        expected = reference.generate(prompt, engine.resolve(request_params))
        assert results[index] == (expected.token_ids, expected.exit_depths), f"request {index}"
    return engine


# Pinned swap space set aside at start: ample, about one victim (the rest pinned on the spot),
# none (every victim pinned on the spot).
SWAP_SPACES_GB = {"pool": 1.0, "pool_overflows": 0.004, "no_pool": 0.0}


@pytest.mark.parametrize("swap_space", list(SWAP_SPACES_GB))
@pytest.mark.parametrize("layout", ["full", "shared"])
def test_fp32_preempted_requests_equal_reference(
    checkpoint: Path, layout: str, swap_space: str
) -> None:
    """200 KV pages for 10 requests of up to 88: requests are swapped to pinned host memory and
    back while they grow, through the swap space or pinned on the spot."""
    engine = Engine(
        EngineConfig.from_options(
            model=str(checkpoint), device="cuda", dtype="float32", kv_layout=layout,
            exit_mode="ouro", attention_backend="triton", max_num_seqs=16, num_kv_pages=200,
            prefill_chunk_size=64, swap_space_gb=SWAP_SPACES_GB[swap_space], **PREEMPTING,
        )
    )  # fmt: skip
    batch, params = prompts(10, seed=3), mixed_params(10, 0.6)
    results = run(engine, batch, params)
    assert engine.stats().num_preemptions > 0
    reference = SerialReference(
        engine.runner.model,  # type: ignore[attr-defined]
        kv_layout=layout,
        exit_mode="ouro",
    )
    for index, (prompt, request_params) in enumerate(zip(batch, params, strict=True)):
        expected = reference.generate(prompt, engine.resolve(request_params))
        assert results[index] == (expected.token_ids, expected.exit_depths), f"request {index}"


def test_fp32_recomputed_requests_equal_reference(checkpoint: Path) -> None:
    """The same pressure with recompute preemption: victims' pages are dropped and their prompt
    and generated tokens prefilled again (through the prompt loop's CUDA graphs, whose slot
    mapping sends exited replayed tokens' writes to the null page)."""
    engine = Engine(
        EngineConfig.from_options(
            model=str(checkpoint), device="cuda", dtype="float32", exit_mode="ouro",
            attention_backend="triton", max_num_seqs=16, num_kv_pages=200,
            prefill_chunk_size=64, preemption_mode="recompute", **PREEMPTING,
        )
    )  # fmt: skip
    batch, params = prompts(10, seed=3), mixed_params(10, 0.6)
    results = run(engine, batch, params)
    assert engine.stats().num_preemptions > 0 and engine.stats().recomputed_tokens > 0
    reference = SerialReference(
        engine.runner.model,  # type: ignore[attr-defined]
        kv_layout="full",
        exit_mode="ouro",
    )
    for index, (prompt, request_params) in enumerate(zip(batch, params, strict=True)):
        expected = reference.generate(prompt, engine.resolve(request_params))
        assert results[index] == (expected.token_ids, expected.exit_depths), f"request {index}"


def bf16_engine(checkpoint: Path, **options: object) -> Engine:
    return Engine(
        EngineConfig.from_options(
            model=str(checkpoint), device="cuda", dtype="bfloat16", exit_mode="ouro",
            **({"max_num_seqs": 64, "num_kv_pages": 8192} | options),
        )
    )  # fmt: skip


def test_bf16_graphs_equal_eager(checkpoint: Path) -> None:
    batch, params = prompts(24, seed=1), mixed_params(24, 0.6)
    graphed = run(bf16_engine(checkpoint, cuda_graphs=True), batch, params)
    eager = run(bf16_engine(checkpoint, cuda_graphs=False), batch, params)
    synchronous = run(
        bf16_engine(checkpoint, cuda_graphs=True, async_scheduling=False), batch, params
    )
    assert graphed == eager == synchronous
    assert len({d for _, depths in graphed for d in depths[1:]}) > 1  # depths really vary


def test_bf16_request_alone_equals_inside_a_batch_of_32(checkpoint: Path) -> None:
    batch, params = prompts(32, seed=2), mixed_params(32, 0.6)
    together = run(bf16_engine(checkpoint), batch, params)
    for index in (0, 7, 31):
        alone = run(bf16_engine(checkpoint), [batch[index]], [params[index]])
        assert alone[0] == together[index], f"request {index} changed with its batch"


def test_batch_invariant_request_alone_equals_inside_a_batch_of_96(checkpoint: Path) -> None:
    """More rows than cuBLAS keeps one order for at Ouro-1.4B's down projection (64); here the
    model is small, so this holds the setting's path to alone == in a batch, not cuBLAS's."""
    batch, params = prompts(96, seed=5), mixed_params(96, 0.6)
    options = {"batch_invariant": True, "max_num_seqs": 96}
    together = run(bf16_engine(checkpoint, **options), batch, params)
    single = bf16_engine(checkpoint, **options)
    for index in (0, 50, 95):
        alone = run(single, [batch[index]], [params[index]])
        assert alone[0] == together[index], f"request {index} changed with its batch"


def steps_without_synchronising(engine: Engine, graphs: GraphedDecodeStep, steps: int) -> None:
    """Step `engine` until no step needs a read-back and `graphs` (the decode step its requests
    run in) has captured, 10 more (every bucket and kind the batch needs is captured by then),
    then `steps` under torch's sync debug mode "error": a host synchronisation fails them."""
    while engine.scheduler.needs_sync() or graphs.num_captured == 0:
        engine.step()
    for _ in range(10):
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_steady_state_steps_do_not_synchronise(checkpoint: Path) -> None:
    engine = bf16_engine(checkpoint)
    for prompt in prompts(8, seed=3):
        engine.add_request(
            prompt, SamplingParams(max_tokens=200, ignore_eos=True, exit_threshold=0.6)
        )
    steps_without_synchronising(engine, engine.runner.graphs, 30)  # type: ignore[attr-defined]
    while engine.has_unfinished_requests():
        engine.step()


def test_auto_runs_a_head_size_triton_does_not_cover_eagerly(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`auto` falls back to the torch backend without graphs (it used to refuse to start)."""
    config = dataclasses.replace(GPU_CONFIG, head_dim=40)
    directory = write_random_checkpoint(tmp_path_factory.mktemp("head40"), config)
    engine = Engine(
        EngineConfig.from_options(
            model=str(directory), device="cuda", dtype="float32", num_kv_pages=256,
            max_num_seqs=4,
        )
    )  # fmt: skip
    assert (engine.info.attention_backend, engine.info.cuda_graphs) == ("torch", False)
    batch, params = prompts(3, seed=4), mixed_params(3, 0.6)
    results = run(engine, batch, params)
    reference = SerialReference(engine.runner.model)  # type: ignore[attr-defined]
    for index, (prompt, request_params) in enumerate(zip(batch, params, strict=True)):
        expected = reference.generate(prompt, engine.resolve(request_params))
        assert results[index] == (expected.token_ids, expected.exit_depths), f"request {index}"
