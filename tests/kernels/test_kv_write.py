"""The Triton KV write against the torch reference write: same slots, nothing else touched."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from loopserve.attention.torch_backend import write_kv as reference_write_kv
from loopserve.kernels.kv_write import cache_value, read_value, write_kv
from loopserve.kv.pages import NULL_PAGE
from loopserve.kv.storage import FP8, KVScales, from_cache, to_cache_dtype

from .batch_specs import DECODE_SPECS, PREFILL_SPECS, HeadShape, build_batch, fp8_storage

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
    kv = fp8_storage(batch)
    before = kv.cache.clone()
    reference_write_kv(kv, batch.layer, batch.k, batch.v, batch.metadata.slot_mapping)
    expected = kv.cache.clone()
    kv.cache.copy_(before)
    key_cache, value_cache = kv.key_cache(batch.layer), kv.value_cache(batch.layer)
    write_kv(batch.k, batch.v, key_cache, value_cache, batch.metadata.slot_mapping)
    assert torch.equal(
        _real_pages(kv.cache).view(torch.uint8), _real_pages(expected).view(torch.uint8)
    )


@triton.jit
def _scaled_cache_values_kernel(x_ptr, inverse_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, cache_value(x, out_ptr, tl.load(inverse_ptr)))


@triton.jit
def _read_values_kernel(stored_ptr, scale_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    read = read_value(tl.load(stored_ptr + offsets), tl.load(scale_ptr), out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, read)


# Scales whose reciprocals are not exact in fp32, a tiny one (most values saturate) and a large
# one (most values land among e4m3's subnormals).
SCALES = [0.0123, 3.7, 1e-3, 40.0]
READ_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scaled_fp8_values_are_torch_s_bit_for_bit(
    dtype: torch.dtype, scale: float, device: torch.device
) -> None:
    """With a layer's scale, `cache_value` (x times the host's fp32 reciprocal, saturated,
    rounded) and `read_value` (stored times the scale in fp32, then the query's dtype) give the
    bits of `kv.storage.to_cache_dtype` and `kv.storage.from_cache`."""
    generator = torch.Generator().manual_seed(1)
    spread = torch.cat([torch.randn(2048, generator=generator) * s for s in (1e-3, 0.5, 40.0)])
    values = torch.cat([torch.tensor([0.0, -0.0, 448 * scale, -449 * scale]), spread])
    values = torch.nn.functional.pad(values, (0, 8192 - values.numel())).to(dtype).to(device)
    scales = KVScales(torch.tensor([[scale, 1.0]]), "calculated")
    inverse = scales.inverse[0, :1].to(device)
    stored = torch.empty(values.shape, dtype=FP8, device=device)
    _scaled_cache_values_kernel[(1,)](values, inverse, stored, N=values.numel())
    expected = to_cache_dtype(values, FP8, scales.inverse[0, 0])
    assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))
    assert (expected.float().abs() == 448.0).any() and (expected.float() != 448.0).any()
    for read_dtype in READ_DTYPES:
        read = torch.empty(values.shape, dtype=read_dtype, device=device)
        _read_values_kernel[(1,)](stored, scales.scale[0, :1].to(device), read, N=values.numel())
        wanted = from_cache(expected, read_dtype, scales.scale[0, 0])
        if read_dtype == torch.bfloat16 and device.type == "cpu":
            # triton 3.9's interpreter truncates fp32 to bf16 (118.4 became 118.0, not 118.5);
            # compiled, the conversion rounds to nearest even and the bits are compared.
            torch.testing.assert_close(read, wanted, rtol=2**-7, atol=0)
            continue
        assert torch.equal(read, wanted), read_dtype


def test_scaled_fp8_write_matches_reference(device: torch.device) -> None:
    """The KV write kernel with the layer's reciprocals stores the torch backend's bits, with
    each layer's own K and V scales (the others' would store other bits)."""
    shape = SHAPES[0]
    batch = build_batch(SPECS["packed_mixed"], shape, device)
    kv = fp8_storage(batch, KVScales(torch.tensor([[0.5, 3.0], [0.002, 0.07]]), "checkpoint"))
    before = kv.cache.clone()
    reference_write_kv(kv, batch.layer, batch.k, batch.v, batch.metadata.slot_mapping)
    expected = kv.cache.clone()
    kv.cache.copy_(before)
    key_cache, value_cache = kv.key_cache(batch.layer), kv.value_cache(batch.layer)
    slots = batch.metadata.slot_mapping
    write_kv(batch.k, batch.v, key_cache, value_cache, slots, kv.inverse_scales[batch.layer])
    written = _real_pages(kv.cache).view(torch.uint8)
    assert torch.equal(written, _real_pages(expected).view(torch.uint8))
    kv.cache.copy_(before)
    write_kv(batch.k, batch.v, key_cache, value_cache, slots, kv.inverse_scales[0])
    assert not torch.equal(_real_pages(kv.cache).view(torch.uint8), written)
    assert (expected.float().abs() == 448.0).any()  # K / 0.002 saturates
