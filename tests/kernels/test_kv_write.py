"""The Triton KV write against the torch reference write: same slots, nothing else touched."""

from __future__ import annotations

import pytest
import torch

from loopserve.attention.torch_backend import write_kv as reference_write_kv
from loopserve.kernels.kv_write import write_kv
from loopserve.kv.pages import NULL_PAGE

from .batch_specs import DECODE_SPECS, PREFILL_SPECS, HeadShape, build_batch

SHAPES = [HeadShape(4, 2, 32, torch.float32), HeadShape(2, 2, 80, torch.bfloat16)]
SPECS = {**DECODE_SPECS, **PREFILL_SPECS}


def _real_pages(cache: torch.Tensor) -> torch.Tensor:
    """cache [L, 2, pages, ...] without the null page, which padding rows may write in any order."""
    keep = torch.ones(cache.shape[2], dtype=torch.bool, device=cache.device)
    keep[NULL_PAGE] = False
    return cache[:, :, keep]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("spec", ["mixed_lengths", "padding_rows", "packed_mixed", "one_prompt"])
def test_write_matches_reference(spec: str, shape: HeadShape, device: torch.device) -> None:
    batch = build_batch(SPECS[spec], shape, device)
    before = batch.kv.cache.clone()
    reference_write_kv(batch.kv, batch.layer, batch.k, batch.v, batch.metadata.slot_mapping)
    expected = batch.kv.cache.clone()
    batch.kv.cache.copy_(before)
    write_kv(
        batch.k,
        batch.v,
        batch.kv.key_cache(batch.layer),
        batch.kv.value_cache(batch.layer),
        batch.metadata.slot_mapping,
    )
    torch.testing.assert_close(
        _real_pages(batch.kv.cache), _real_pages(expected), rtol=0, atol=0, equal_nan=True
    )
    written = batch.kv.cache[batch.layer, 0].flatten(0, 1)[batch.metadata.slot_mapping]
    real_rows = batch.metadata.slot_mapping >= batch.kv.block_size  # not in the null page
    assert not written[real_rows].isnan().any()


def test_write_reads_strided_inputs(device: torch.device) -> None:
    """k and v as views into one fused projection output (token stride != heads * head_dim)."""
    shape = HeadShape(2, 2, 32, torch.float32)
    batch = build_batch(DECODE_SPECS["mixed_lengths"], shape, device)
    fused = torch.randn(batch.k.shape[0], 3, 2, 32, device=device)  # [T, q|k|v, Nkv, D]
    k, v = fused[:, 1], fused[:, 2]
    write_kv(
        k,
        v,
        batch.kv.key_cache(batch.layer),
        batch.kv.value_cache(batch.layer),
        batch.metadata.slot_mapping,
    )
    slots = batch.metadata.slot_mapping
    keys = batch.kv.key_cache(batch.layer).flatten(0, 1)[slots]
    values = batch.kv.value_cache(batch.layer).flatten(0, 1)[slots]
    assert torch.equal(keys, k) and torch.equal(values, v)
