"""`kernels.e4m3.quantize_rows`: fp8 activations, bit for bit as `models.quant.quantize_activations`
quantizes them (each row's scale from its largest |x|, correctly rounded divisions, e4m3 rounding
to nearest even with the sign of zero kept); and the cache's e4m3 values read back as
`kv.storage.from_cache` reads them (`kernels.kv_write.read_value`)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from loopserve.kernels.e4m3 import MAX_ROW, quantize_rows, triton_dtype
from loopserve.kernels.kv_write import read_value
from loopserve.kv.storage import FP8, from_cache
from loopserve.models.quant import quantize_activations


def _rows(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rows spanning e4m3's subnormals to large values, a row of zeros (signed), a row whose
    largest value is negative, and rows with ties after scaling."""
    generator = torch.Generator().manual_seed(3)
    spread = torch.randn(6, 300, generator=generator)
    spread *= torch.tensor([1e-3, 0.5, 40.0, 3e3, 1.0, 7.0])[:, None]
    spread[4, 11] = -9.0
    zeros = torch.zeros(1, 300)
    zeros[0, ::2] = -0.0
    ties = torch.tensor([896.0, 19.0, -21.0, 17.0, -0.0, 1e-6] * 50)[None, :]
    # Many largest values: 448 / amax once rounded differs from amax's reciprocal times 448 for
    # some of them (what torch's `448 / tensor` computes), and a mix-up shows.
    many = torch.randn(512, 300, generator=generator) * torch.rand(512, 1, generator=generator)
    return torch.cat([spread, zeros, ties, many]).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_are_quantized_as_torch_quantizes_them(
    dtype: torch.dtype, device: torch.device
) -> None:
    x = _rows(dtype, device)
    got, scale = quantize_rows(x)
    expected, expected_scale = quantize_activations(x)
    assert got.dtype == expected.dtype and torch.equal(scale, expected_scale)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # -0 stays -0


def test_rows_as_wide_as_huginns_mlp(device: torch.device) -> None:
    """Huginn-0125's down projection reads rows of 17,920 values: one block holds them."""
    x = torch.randn(2, 17920, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    got, scale = quantize_rows(x)
    expected, expected_scale = quantize_activations(x)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


def test_strided_rows_and_the_limits(device: torch.device) -> None:
    x = _rows(torch.bfloat16, device)
    wide = torch.cat([x, x], dim=1)[:, 300:]  # rows 600 apart
    got, scale = quantize_rows(wide)
    expected, expected_scale = quantize_activations(x)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale, expected_scale)
    assert quantize_rows(x[:0])[0].shape == (0, 300)
    with pytest.raises(ValueError, match=f"rows of at most {MAX_ROW} contiguous values"):
        quantize_rows(x.t())
    with pytest.raises(ValueError, match="no rounding to"):
        triton_dtype(torch.int8)
    assert triton_dtype(torch.bfloat16) == tl.bfloat16


@triton.jit
def _read_kernel(x_ptr, scale_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, read_value(x, tl.load(scale_ptr), out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", [1.0, 0.0625, 0.3, 7.3e-5, 96.0])
def test_cache_values_read_as_torch_reads_them(
    dtype: torch.dtype, scale: float, device: torch.device
) -> None:
    """Every finite e4m3 value (subnormals, both zeros, +-448) read from the cache with a layer
    scale: `kv.storage.from_cache`'s bits."""
    if device.type == "cpu" and dtype == torch.bfloat16 and scale in (0.3, 7.3e-5):
        pytest.skip("triton 3.9's interpreter truncates fp32 to bf16 where torch rounds to nearest")
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    bits = torch.tensor(finite + finite[:2], dtype=torch.uint8)  # 256: a power of two
    padded = bits.view(FP8).to(device)
    scales = torch.tensor([scale], dtype=torch.float32, device=device)
    out = torch.empty(256, dtype=dtype, device=device)
    _read_kernel[(1,)](padded, scales, out, N=256)
    expected = from_cache(padded, dtype, scales[0])
    as_bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # -0 stays -0
    assert torch.equal(out.view(as_bits), expected.view(as_bits))
