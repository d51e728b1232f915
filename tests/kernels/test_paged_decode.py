"""Paged decode kernels against the float64 dense reference and the torch backend.

Both tile paths (CUDA-core lanes, tensor-core dots), the fused and the separate combine, the fused
KV write (every tiling the decode sweep can launch is checked with these helpers by
benchmarks/tests/test_sweep_tilings.py). Batch invariance: a row's bits alone equal its bits in
a batch, for any programs per row.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loopserve.attention.base import AttentionSpec
from loopserve.attention.torch_backend import TorchAttentionBackend
from loopserve.attention.torch_backend import write_kv as reference_write_kv
from loopserve.kernels.fused_ops import rotary_qk_
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

MHA = HeadShape(2, 2, 32, torch.bfloat16)
MHA_FP32 = HeadShape(2, 2, 32, torch.float32)
GQA = HeadShape(4, 2, 32, torch.float32)  # group 2
PADDED = HeadShape(6, 2, 80, torch.float16)  # group 3, head dim padded to 128
GQA6 = HeadShape(6, 1, 32, torch.bfloat16)  # Nanbeige4.2's group (48 / 8)
# Tiny partitions so that CPU-sized rows have several, and rows over 64 tokens double them.
LANES = DecodeTiling(tensor_cores=False, heads_per_program=1, block_n=8, partition_min=16)
DOTS = DecodeTiling(tensor_cores=True, heads_per_program=16, block_n=16, partition_min=32)
SMALL = {"max_partitions": 4}
PATHS = {"lanes": dataclasses.replace(LANES, **SMALL), "dots": dataclasses.replace(DOTS, **SMALL)}


def decode(
    batch: Batch,
    tiling: DecodeTiling,
    splits: int,
    *,
    fused_write: bool = False,
    last_combines: bool = False,
    only_row: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode output [T, Nq, D] of the batch (or of row `only_row` alone) into a poisoned out.

    With `fused_write` the kernel stores this pass's K/V itself (the batch's cache must not have
    them yet); otherwise they must already be written.
    """
    q, k, v, metadata = batch.q, batch.k, batch.v, batch.metadata
    if only_row is not None:
        metadata, tokens = decode_subset(batch, [only_row])
        q, k, v = q[tokens], k[tokens], v[tokens]
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
        new_kv=(k, v) if fused_write else None,
        rope=rope,
        last_program_combines=last_combines,
    )
    assert not workspace.arrivals.any()  # the last program of a row leaves its count at 0
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


def assert_matches(out: torch.Tensor, batch: Batch, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out.double().cpu(), dense_reference(batch), **tolerance(dtype))
    padding = torch.tensor([row.seq_len == 0 for row in batch.rows])
    assert torch.all(out.cpu()[padding] == 0)


# Every spec on the MHA shape with the lanes path (Ouro's) and on the GQA shape with the dots
# path; the padded shape on the specs that stress masking (the interpreter is slow; the GPU run
# covers every shape at full size).
CASES = [(spec, MHA, "lanes") for spec in sorted(DECODE_SPECS)]
CASES += [(spec, GQA, "dots") for spec in sorted(DECODE_SPECS)]
CASES += [(spec, PADDED, path) for spec in ("long_rows", "padding_rows") for path in PATHS]
CASES += [(spec, GQA6, path) for spec in ("mixed_lengths", "planes") for path in PATHS]


@pytest.mark.parametrize(
    ("spec", "shape", "path"), CASES, ids=[f"{s}-{h}-{p}" for s, h, p in CASES]
)
def test_decode_matches_references(
    spec: str, shape: HeadShape, path: str, device: torch.device
) -> None:
    """Three programs per row (separate combine; rows of one partition finish in the kernel)."""
    batch = build_batch(DECODE_SPECS[spec], shape, device, seed=len(spec))
    reference = _torch_backend_output(batch, shape)  # also writes this pass's K/V
    out = decode(batch, PATHS[path], splits=3)
    assert_matches(out, batch, shape.dtype)
    torch.testing.assert_close(out.cpu(), reference.cpu(), **tolerance(shape.dtype))


@pytest.mark.parametrize("path", PATHS)
def test_fused_kv_write_and_combine(path: str, device: torch.device) -> None:
    """One program per row (combined in the kernel), writing the new K/V itself: the slots hold
    NaN until then, so a missing or misplaced write fails; the written cache equals kv_write's."""
    shape = GQA
    batch = build_batch(DECODE_SPECS["mixed_lengths"], shape, device, seed=5)
    out = decode(batch, PATHS[path], splits=1, fused_write=True)
    assert_matches(out, batch, shape.dtype)
    fused_cache = batch.kv.cache[batch.layer].clone()
    _written(batch)
    assert torch.equal(fused_cache.nan_to_num(7.0), batch.kv.cache[batch.layer].nan_to_num(7.0))


# The rotation runs before the two tile paths split, so the padded head dim needs one of them.
ROTARY_CASES = [(MHA, "lanes"), (GQA, "dots"), (PADDED, "dots")]


@pytest.mark.parametrize(("shape", "path"), ROTARY_CASES, ids=[f"{s}-{p}" for s, p in ROTARY_CASES])
def test_rotary_in_the_kernel_equals_rotary_then_decode(
    shape: HeadShape, path: str, device: torch.device
) -> None:
    """RoPE applied by the decode kernel (q in a scratch copy, k on its way into the cache)
    gives the bits of `rotary_qk_` followed by the kernel: the output and every cache byte; q and
    k are left unrotated. Split programs share the row (the scratch is written by each)."""
    rows = DECODE_SPECS["mixed_lengths"]
    tokens = len(rows)
    angles = torch.Generator().manual_seed(3)
    cos = torch.randn(tokens, shape.head_dim, generator=angles).to(shape.dtype).to(device)
    sin = torch.randn(tokens, shape.head_dim, generator=angles).to(shape.dtype).to(device)
    separate = build_batch(rows, shape, device, seed=9)
    q, k = rotary_qk_(separate.q.clone(), separate.k.clone(), cos, sin)
    expected = decode(dataclasses.replace(separate, q=q, k=k), PATHS[path], 3, fused_write=True)
    fused = build_batch(rows, shape, device, seed=9)
    q_before, k_before = fused.q.clone(), fused.k.clone()
    out = decode(fused, PATHS[path], 3, fused_write=True, last_combines=True, rope=(cos, sin))
    assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0))
    cache, expected_cache = fused.kv.cache[fused.layer], separate.kv.cache[separate.layer]
    assert torch.equal(cache.nan_to_num(7.0), expected_cache.nan_to_num(7.0))
    assert torch.equal(fused.q, q_before) and torch.equal(fused.k, k_before)
    assert not torch.equal(q, q_before)  # the rotation did something


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("shape", [MHA, GQA], ids=str)
def test_decode_is_batch_invariant(shape: HeadShape, path: str, device: torch.device) -> None:
    """A row's output is bitwise the same alone, in a batch, for any programs-per-row, with the
    fold in the decode kernel (one program per row, or the last one of the row) or separate,
    and with the K/V write fused or not."""
    batch = _written(build_batch(DECODE_SPECS["long_rows"], shape, device))
    tiling = PATHS[path]
    in_batch = [decode(batch, tiling, splits) for splits in (1, 2, 5)]
    in_batch.append(decode(batch, tiling, 3, fused_write=True))
    in_batch.append(decode(batch, tiling, 3, last_combines=True))
    for index in (0, 1):  # 300 and 77 tokens: several partitions each
        alone = decode(batch, tiling, splits=4, only_row=index)
        for out in in_batch:
            assert torch.equal(out[index], alone[0])
    assert_matches(in_batch[0], batch, shape.dtype)


def test_decode_leaves_prompt_rows_alone(device: torch.device) -> None:
    """In a mixed batch the decode kernels write exactly the one-token rows."""
    shape = GQA
    batch = _written(build_batch(PREFILL_SPECS["packed_mixed"], shape, device))
    expected = dense_reference(batch)
    for tiling, splits in ((PATHS["lanes"], 2), (PATHS["dots"], 1)):
        out = decode(batch, tiling, splits=splits).cpu()
        starts = batch.starts
        for index, row in enumerate(batch.rows):
            rows = slice(starts[index], starts[index + 1])
            if row.query_len == 1:
                torch.testing.assert_close(
                    out[rows].double(), expected[rows], **tolerance(shape.dtype)
                )
            else:
                assert out[rows].isnan().all()
