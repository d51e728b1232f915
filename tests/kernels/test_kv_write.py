"""The Triton KV write against the torch reference write: same slots, nothing else touched."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from loopserve.attention.torch_backend import write_kv as reference_write_kv
from loopserve.kernels.kv_write import cache_value, write_kv
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import FP8, KVStorage, to_cache_dtype

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


@triton.jit
def _cache_values_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, cache_value(tl.load(x_ptr + offsets), out_ptr))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_cache_values_are_torch_s_bit_for_bit(dtype: torch.dtype, device: torch.device) -> None:
    """`kv_write.cache_value` into a float8 e4m3 cache == `kv.storage.to_cache_dtype`: saturation
    at +-448, subnormals, ties to even, signed zeros, and values whose rounding carries into the
    exponent (which triton 3.9's interpreter gets wrong by a plain conversion)."""
    edges = [-0.0, 0.0, 448.0, -500.0, 1e-9, -1e-9, 1.5 * 2**-9, 7.78, -1.99, 2**-6, 0.0146]
    generator = torch.Generator().manual_seed(0)
    spread = torch.cat([torch.randn(4096, generator=generator) * s for s in (0.01, 3.0, 300.0)])
    values = torch.cat([torch.tensor(edges), spread])
    values = torch.nn.functional.pad(values, (0, 16384 - values.numel())).to(dtype).to(device)
    out = torch.empty(values.shape, dtype=FP8, device=device)
    _cache_values_kernel[(1,)](values, out, N=values.numel())
    expected = to_cache_dtype(values, FP8)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))


def test_fp8_write_matches_reference(device: torch.device) -> None:
    """The KV write kernel into an fp8 cache stores the reference write's bits."""
    shape = SHAPES[0]
    batch = build_batch(SPECS["packed_mixed"], shape, device)
    kv = KVStorage(
        num_layers=2, num_pages=batch.kv.num_pages, block_size=batch.kv.block_size,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype=FP8, device=device,
    )  # fmt: skip
    kv.cache.copy_(to_cache_dtype(batch.kv.cache, FP8))
    before = kv.cache.clone()
    reference_write_kv(kv, batch.layer, batch.k, batch.v, batch.metadata.slot_mapping)
    expected = kv.cache.clone()
    kv.cache.copy_(before)
    key_cache, value_cache = kv.key_cache(batch.layer), kv.value_cache(batch.layer)
    write_kv(batch.k, batch.v, key_cache, value_cache, batch.metadata.slot_mapping)
    assert torch.equal(
        _real_pages(kv.cache).view(torch.uint8), _real_pages(expected).view(torch.uint8)
    )
