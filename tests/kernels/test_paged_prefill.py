"""Packed causal prefill kernel against the float64 dense reference and the torch backend."""

from __future__ import annotations

import pytest
import torch

from loopserve.attention.torch_backend import write_kv as reference_write_kv
from loopserve.kernels.paged_prefill import PrefillTiling, build_tile_map, paged_prefill_attention

from .batch_specs import PREFILL_SPECS, Batch, HeadShape, build_batch, dense_reference, tolerance

SHAPES = [
    HeadShape(4, 2, 32, torch.float32),
    HeadShape(2, 2, 32, torch.bfloat16),
    HeadShape(3, 1, 80, torch.float16),  # group 3, padded head dim
    HeadShape(6, 1, 32, torch.bfloat16),  # group 6 (Nanbeige4.2's 48 / 8)
]
SMALL_TILES = PrefillTiling(block_m=16, block_n=16)  # several query and KV tiles per sequence


def _prefill(batch: Batch, tiling: PrefillTiling) -> torch.Tensor:
    """Prefill output [T, Nq, D] into a NaN-poisoned out; rows of query length 1 stay NaN."""
    reference_write_kv(batch.kv, batch.layer, batch.k, batch.v, batch.metadata.slot_mapping)
    metadata = batch.metadata
    seq_lens = [row.seq_len for row in batch.rows]
    tiles = build_tile_map(batch.starts, seq_lens, tiling.block_m)
    tile_tensor = torch.tensor(tiles, dtype=torch.int32, device=batch.q.device).reshape(-1, 2)
    out = torch.full_like(batch.q, float("nan"))
    paged_prefill_attention(
        batch.q,
        batch.kv.key_cache(batch.layer),
        batch.kv.value_cache(batch.layer),
        metadata,
        tile_tensor,
        out,
        scale=batch.q.shape[-1] ** -0.5,
        tiling=tiling,
    )
    return out


def _check(batch: Batch, out: torch.Tensor, dtype: torch.dtype) -> None:
    expected = dense_reference(batch)
    starts = batch.starts
    for index, row in enumerate(batch.rows):
        rows = slice(starts[index], starts[index + 1])
        if row.query_len > 1:
            torch.testing.assert_close(out[rows].double().cpu(), expected[rows], **tolerance(dtype))
        else:  # the decode kernels own these rows
            assert out[rows].isnan().all()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", sorted(PREFILL_SPECS))
def test_prefill_small_tiles(spec: str, shape: HeadShape, device: torch.device) -> None:
    batch = build_batch(PREFILL_SPECS[spec], shape, device, seed=len(spec))
    _check(batch, _prefill(batch, SMALL_TILES), shape.dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", ["packed_mixed", "chunk_after_ragged_context"])
def test_prefill_default_tiles(spec: str, shape: HeadShape, device: torch.device) -> None:
    batch = build_batch(PREFILL_SPECS[spec], shape, device)
    _check(
        batch, _prefill(batch, PrefillTiling.for_shape(shape.head_dim, shape.dtype)), shape.dtype
    )


def test_tile_map_covers_every_prompt_query_once() -> None:
    starts = [0, 40, 41, 42, 67, 68, 71, 71]
    seq_lens = [40, 17, 0, 70, 5, 3, 9]
    tiles = build_tile_map(starts, seq_lens, block_m=16)
    covered = []
    for sequence, first in tiles:
        query_len = starts[sequence + 1] - starts[sequence]
        assert query_len > 1 and first % 16 == 0
        covered += [(sequence, i) for i in range(first, min(first + 16, query_len))]
    expected = (
        [(0, i) for i in range(40)] + [(3, i) for i in range(25)] + [(5, i) for i in range(3)]
    )
    assert sorted(covered) == sorted(expected)
    extents = [min(seq_lens[s], seq_lens[s] - starts[s + 1] + starts[s] + f + 16) for s, f in tiles]
    assert extents == sorted(extents, reverse=True)
