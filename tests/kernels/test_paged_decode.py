"""Paged decode kernels against the float64 dense reference and the torch backend."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.attention.torch_backend import write_kv as reference_write_kv
from loopserve.kernels.paged_decode import DecodeTiling, new_workspace, paged_decode_attention

from .batch_specs import (
    DECODE_SPECS,
    PREFILL_SPECS,
    Batch,
    HeadShape,
    build_batch,
    decode_subset,
    dense_reference,
    tolerance,
)

SHAPES = [
    HeadShape(4, 2, 32, torch.float32),  # GQA, group 2
    HeadShape(2, 2, 32, torch.bfloat16),
    HeadShape(6, 2, 80, torch.float16),  # group 3 (a padded head per program), padded head dim
]
# Tiny partitions so that the CPU-sized rows have several, and rows over 64 tokens double them.
SMALL_PARTITIONS = {"partition_min": 16, "max_partitions": 4}


def _tiling(shape: HeadShape, **changes: int) -> DecodeTiling:
    group = shape.num_heads // shape.num_kv_heads
    return dataclasses.replace(DecodeTiling.for_shape(group, shape.head_dim), **changes)


def _decode(
    batch: Batch, tiling: DecodeTiling, splits: int, only_row: int | None = None
) -> torch.Tensor:
    """Decode output [T, Nq, D] of the batch (or of row `only_row` alone) into a poisoned out."""
    q, metadata = batch.q, batch.metadata
    if only_row is not None:
        metadata, tokens = decode_subset(batch, [only_row])
        q = q[tokens]
    rows, block_size = metadata.seq_lens.shape[0], batch.kv.block_size
    partitions = tiling.partitions_bound(metadata.page_table.shape[1] * block_size)
    num_heads, head_dim = q.shape[1], q.shape[2]
    workspace = new_workspace(rows, num_heads, head_dim, partitions, q.device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q,
        batch.kv.key_cache(batch.layer),
        batch.kv.value_cache(batch.layer),
        metadata,
        out,
        workspace,
        scale=head_dim**-0.5,
        num_split_programs=splits,
        tiling=tiling,
    )
    return out


def _written(batch: Batch) -> Batch:
    reference_write_kv(batch.kv, batch.layer, batch.k, batch.v, batch.metadata.slot_mapping)
    return batch


def _torch_backend_output(batch: Batch, shape: HeadShape) -> torch.Tensor:
    spec = AttentionSpec(
        device_type=batch.q.device.type,
        compute_capability=None,
        dtype=shape.dtype,
        head_size=shape.head_dim,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        block_size=batch.kv.block_size,
        cuda_graphs=False,
    )
    backend = TorchAttentionBackend(spec)
    return backend.forward(batch.q, batch.k, batch.v, batch.kv, batch.layer, batch.metadata)


# Every spec in the first two shapes; the padded-heads, padded-head-dim shape on the specs that
# stress masking (the interpreter is slow, and the GPU run covers every shape at full size).
CASES = [(spec, shape) for shape in SHAPES[:2] for spec in sorted(DECODE_SPECS)] + [
    (spec, SHAPES[2]) for spec in ("long_rows", "padding_rows", "page_boundaries")
]


@pytest.mark.parametrize(("spec", "shape"), CASES, ids=[f"{s}-{h}" for s, h in CASES])
def test_decode_matches_references(spec: str, shape: HeadShape, device: torch.device) -> None:
    batch = build_batch(DECODE_SPECS[spec], shape, device, seed=len(spec))
    reference = _torch_backend_output(batch, shape)  # also writes this pass's K/V
    out = _decode(batch, _tiling(shape, **SMALL_PARTITIONS), splits=3)
    expected = dense_reference(batch)
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(shape.dtype))
    torch.testing.assert_close(out.cpu(), reference.cpu(), **tolerance(shape.dtype))
    padding = torch.tensor([row.seq_len == 0 for row in batch.rows])
    assert torch.all(out.cpu()[padding] == 0)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_decode_default_tiling(shape: HeadShape, device: torch.device) -> None:
    batch = _written(build_batch(DECODE_SPECS["mixed_lengths"], shape, device))
    out = _decode(batch, _tiling(shape), splits=2)
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(shape.dtype))


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_decode_is_batch_invariant(shape: HeadShape, device: torch.device) -> None:
    """A row's output is bitwise the same alone, in a batch, and for any programs-per-row."""
    batch = _written(build_batch(DECODE_SPECS["long_rows"], shape, device))
    tiling = _tiling(shape, **SMALL_PARTITIONS)
    in_batch = [_decode(batch, tiling, splits=splits) for splits in (1, 2, 5)]
    for index in (0, 1):  # 300 and 77 tokens: several partitions each
        alone = _decode(batch, tiling, splits=4, only_row=index)
        for out in in_batch:
            assert torch.equal(out[index], alone[0])
    torch.testing.assert_close(
        in_batch[0].double().cpu(), dense_reference(batch), **tolerance(shape.dtype)
    )


def test_decode_leaves_prompt_rows_alone(device: torch.device) -> None:
    """In a mixed batch the decode kernels write exactly the one-token rows."""
    shape = SHAPES[0]
    batch = _written(build_batch(PREFILL_SPECS["packed_mixed"], shape, device))
    out = _decode(batch, _tiling(shape, **SMALL_PARTITIONS), splits=2).cpu()
    starts = batch.starts
    expected = dense_reference(batch)
    for index, row in enumerate(batch.rows):
        rows = slice(starts[index], starts[index + 1])
        if row.query_len == 1:
            torch.testing.assert_close(out[rows].double(), expected[rows], **tolerance(shape.dtype))
        else:
            assert out[rows].isnan().all()
