"""Prompt loops through `GraphedPromptLoop` (padded passes; CUDA graphs on a GPU) are the eager
prompt path, bit for bit.

Two prompt runners over one model and equal KV caches run the same steps of prompt chunks: one
eagerly, one through the graphed loop. Every layer's K/V of every plane (the null page aside:
padding writes there) and the sampled first tokens must agree. The chunks start after earlier
chunks of their request (context in the cache), need different loop counts (later loops run a
subset of the tokens) and pad to a bucket. On the CPU
the padded passes run in triton's interpreter, uncaptured; with `-m gpu` they are captured and
replayed. On a GPU the K/V are compared bit for bit; on the CPU, fp32 K/V within 1e-6, since some
CPUs' fp32 matmul kernels (AVX-512 MKL among them, seen on 2026-12-02: 181 of 393,216 values off
by at most 3e-8) block the rows by the row count, which padding changes; the sampled tokens and
bf16 K/V must still be equal there.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import pytest
import torch

from loopserve.attention.triton_backend import TritonAttentionBackend
from loopserve.engine.scheduler_output import PrefillChunk
from loopserve.kernels.paged_prefill import PADDING_TILE, padded_tile_map, tile_capacity
from loopserve.kv.pages import NULL_PAGE
from loopserve.runner.block_tables import PromptPass
from loopserve.runner.prefill import PromptRunner
from loopserve.runner.prompt_graphs import TOKEN_BUCKETS, GraphedPromptLoop, token_bucket
from loopserve.sampling_params import SamplingInfo, SamplingParams
from tests.kernels.tiny_setup import attention_spec, paged_kv, shuffled_pages, tiny_model

SLOTS, PAGES, BLOCK = 6, 16, 4


@dataclass
class Runners:
    eager: PromptRunner
    graphed: PromptRunner
    loops: GraphedPromptLoop


def _runners(device: torch.device, dtype: torch.dtype, max_tokens: int) -> Runners:
    model = tiny_model(device, dtype, seed=0)
    backend = TritonAttentionBackend(attention_spec(model, device, BLOCK))
    pages = shuffled_pages(SLOTS, model.config.num_loops, PAGES, torch.Generator().manual_seed(1))
    # Equal caches: each drawn from a generator in the same state.
    kv0, tables0 = paged_kv(model, pages, BLOCK, device, torch.Generator().manual_seed(2))
    kv1, tables1 = paged_kv(model, pages, BLOCK, device, torch.Generator().manual_seed(2))
    loops = GraphedPromptLoop(model, kv1, backend, tables1, max_tokens, SLOTS)
    return Runners(
        PromptRunner(model, kv0, backend, tables0),
        PromptRunner(model, kv1, backend, tables1, loops),
        loops,
    )


def _chunk(slot: int, start: int, length: int, loops: int, seed: int) -> PrefillChunk:
    generator = torch.Generator().manual_seed(seed)
    return PrefillChunk(
        request_id=f"r{slot}",
        slot=slot,
        start=start,
        token_ids=torch.randint(0, 512, (length,), generator=generator).tolist(),
        num_loops=loops,
        completes_prompt=slot % 2 == 0,
        sampling=SamplingInfo(SamplingParams(temperature=0.0, logprobs=2), seed, 0),
    )


def _without_null_page(runner: PromptRunner) -> torch.Tensor:
    cache = runner.kv.cache
    keep = torch.ones(cache.shape[2], dtype=torch.bool)
    keep[NULL_PAGE] = False
    return cache[:, :, keep.to(cache.device)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_prompt_loops_equal_eager(
    device: torch.device, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    runners = _runners(device, dtype, max_tokens=100)  # buckets up to 64
    padded_passes = []
    run = runners.loops.run
    monkeypatch.setattr(
        runners.loops, "run", lambda h, c, s, p: padded_passes.append(h.shape[0]) or run(h, c, s, p)
    )
    steps = [
        # chunks with context already in the cache: 36 tokens pad to 64
        [_chunk(0, 5, 16, 4, 13), _chunk(3, 0, 20, 4, 14)],
        # 5 + 9 + 3 tokens pad to 32 (over the first step's stale buffers); loops 4, 2, 3, so
        # loops 3 and 4 run 8 and 5 tokens (16)
        [_chunk(4, 0, 5, 4, 10), _chunk(1, 8, 9, 2, 11), _chunk(2, 3, 3, 3, 12)],
    ]
    for index, chunks in enumerate(steps):
        expected = runners.eager.run(chunks)
        got = runners.graphed.run(chunks)
        assert got == expected, f"step {index}"
        cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        torch.testing.assert_close(
            _without_null_page(runners.graphed),
            _without_null_page(runners.eager),
            rtol=0,
            atol=1e-6 if cpu_fp32 else 0,
            msg=lambda m, i=index: f"step {i}: {m}",
        )
    assert padded_passes == [36, 36, 36, 36, 17, 17, 8, 5]
    if device.type == "cuda":
        assert runners.loops.num_captured == 3  # buckets 16, 32 and 64


def test_what_fits_a_graph() -> None:
    """Passes over the largest bucket within `max_tokens`, over more sequences than slots or
    with a one-token chunk (the decode kernel's) run eagerly."""
    runners = _runners(torch.device("cpu"), torch.float32, max_tokens=100)

    def prompt(lengths: list[int]) -> PromptPass:
        tokens = sum(lengths)
        return PromptPass(
            slots=torch.arange(len(lengths)),
            plane=0,
            positions=torch.arange(tokens),
            sequence_of_token=torch.zeros(tokens, dtype=torch.int64),
            query_start=[0, *accumulate(lengths)],
            seq_lens=lengths,
        )

    assert runners.loops.max_tokens == 64
    assert runners.loops.fits(prompt([30, 34]))
    assert not runners.loops.fits(prompt([30, 35]))
    assert not runners.loops.fits(prompt([30, 1]))
    assert not runners.loops.fits(prompt([2] * (SLOTS + 1)))


def test_token_buckets() -> None:
    assert list(TOKEN_BUCKETS) == sorted(set(TOKEN_BUCKETS))
    assert token_bucket(1, 2048) == 16
    assert token_bucket(1000, 2048) == 1024
    assert token_bucket(1025, 2048) == 1280
    assert token_bucket(2048, 2048) == 2048
    assert token_bucket(2049, 2048) is None
    assert token_bucket(1500, 1400) is None
    assert token_bucket(1100, 1300) == 1280  # a bucket within max_tokens


def test_padded_tile_map_fits_its_capacity() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        sequences = int(torch.randint(1, 6, (1,), generator=generator))
        lengths = torch.randint(2, 40, (sequences,), generator=generator).tolist()
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        tokens = starts[-1] + int(torch.randint(0, 16, (1,), generator=generator))
        seq_lens = [length + 3 for length in lengths]
        capacity = tile_capacity(tokens, sequences + 2, 16)
        tiles = padded_tile_map(starts, seq_lens, 16, capacity)
        assert len(tiles) == capacity
        real = [tile for tile in tiles if tile != PADDING_TILE]
        assert tiles[len(real) :] == [PADDING_TILE] * (capacity - len(real))
    with pytest.raises(ValueError, match="do not fit"):
        padded_tile_map([0, 40], [40], 16, 2)
