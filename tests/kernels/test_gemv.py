"""`kernels.gemv.fp8_gemv`: `models.quant`'s fp8 rule (fp32 sums of x times the e4m3 values,
scaled per row, rounded to x's dtype) a row at a time, with SiLU·up and row masks on top, and a
row's bits the same at every row count (the kernel never mixes rows); on the GPU also at
Ouro-1.4B's shapes under every candidate tiling the benchmark tries."""

from __future__ import annotations

import pytest
import torch

from loopserve.kernels.fused_ops import silu_mul
from loopserve.kernels.gemv import MAX_UNROLL, GemvTiling, fp8_gemv
from loopserve.models.quant import fp8_linear, quantize_activations
from tests.kernels.conftest import ON_GPU
from tests.kernels.test_fp8_matmul import _exact, _fp8_operands

SMALL = GemvTiling(16, 128, 4)  # K tails at depth 300, N tails at 40 columns
# More K slices than `MAX_UNROLL`: the K loop is a loop.
THIN = GemvTiling(8, 16, 1)
assert 300 // THIN.block_k > MAX_UNROLL
WHOLE = GemvTiling(8, 512, 4)  # one K slice: the weight loaded before the row's scale is found
TILINGS = [SMALL, THIN, WHOLE]


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("depth", [300, 512])  # a K tail; none
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_are_scaled_sums(
    device: torch.device, dtype: torch.dtype, depth: int, tiling: GemvTiling
) -> None:
    x, weight, scale = _fp8_operands(3, depth, 40, dtype, device)
    got = fp8_gemv(x, weight, scale, tiling=tiling)
    assert got.dtype == dtype and got.shape == (3, 40)
    tolerance = (
        {"rtol": 1e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    )
    torch.testing.assert_close(got.double(), _exact(x, weight, scale), **tolerance)
    torch.testing.assert_close(got, fp8_linear(x, weight, scale), **tolerance)


@pytest.mark.parametrize("tiling", [SMALL, WHOLE])
def test_a_row_has_the_same_bits_at_every_row_count(
    device: torch.device, tiling: GemvTiling
) -> None:
    x, weight, scale = _fp8_operands(7, 300, 40, torch.bfloat16, device)
    every = fp8_gemv(x, weight, scale, tiling=tiling)
    for rows in (1, 2, 5):
        assert torch.equal(fp8_gemv(x[:rows], weight, scale, tiling=tiling), every[:rows])
    assert torch.equal(fp8_gemv(x[4:5], weight, scale, tiling=tiling), every[4:5])


@pytest.mark.parametrize("tiling", [SMALL, WHOLE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_scales_each_half_by_its_rows(
    device: torch.device, dtype: torch.dtype, tiling: GemvTiling
) -> None:
    x, weight, scale = _fp8_operands(3, 300, 2 * 24, dtype, device)
    scale = scale * torch.linspace(0.5, 2.0, scale.numel(), device=device)
    gate, up = fp8_gemv(x, weight, scale, tiling=tiling).chunk(2, dim=-1)
    got = fp8_gemv(x, weight, scale, swiglu=True, tiling=tiling)
    expected = silu_mul(gate.contiguous(), up.contiguous())
    if ON_GPU or dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:  # the interpreter's numpy may round a column by its place in the block
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tiling", [SMALL, WHOLE])
def test_rows_wanted_keeps_their_values_and_zeroes_the_rest(
    device: torch.device, tiling: GemvTiling
) -> None:
    x, weight, scale = _fp8_operands(5, 96, 40, torch.bfloat16, device)
    wanted = torch.tensor([True, False, False, True, False], device=device)
    every = fp8_gemv(x, weight, scale, tiling=tiling)
    some = fp8_gemv(x, weight, scale, wanted, out_dtype=torch.float32, tiling=tiling)
    assert torch.equal(some[wanted], every[wanted].float()) and not some[~wanted].any()


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_that_come_quantized_give_the_same_bits(
    device: torch.device, dtype: torch.dtype, tiling: GemvTiling
) -> None:
    """fp8 rows with their scales (what `kernels.fused_ops.add_norm` hands on) skip the kernel's
    own quantization and give its bits, SiLU·up and row masks included."""
    x, weight, scale = _fp8_operands(3, 300, 2 * 24, dtype, device)
    x8, x_scale = quantize_activations(x)
    made = {"x_scale": x_scale, "dtype": dtype}
    assert torch.equal(fp8_gemv(x8, weight, scale, tiling=tiling, **made),
                       fp8_gemv(x, weight, scale, tiling=tiling))  # fmt: skip
    swiglu = fp8_gemv(x, weight, scale, swiglu=True, tiling=tiling)
    assert torch.equal(fp8_gemv(x8, weight, scale, swiglu=True, tiling=tiling, **made), swiglu)
    wanted = torch.tensor([False, True, False], device=device)
    some = fp8_gemv(x8, weight, scale, wanted, tiling=tiling, **made)
    every = fp8_gemv(x, weight, scale, tiling=tiling)
    assert torch.equal(some[1], every[1]) and not some[~wanted].any()


def test_refuses_what_it_cannot_compute(device: torch.device) -> None:
    x, weight, scale = _fp8_operands(2, 64, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match="W must be float8_e4m3fn"):
        fp8_gemv(x, weight.to(torch.bfloat16), scale)
    with pytest.raises(ValueError, match="W must be float8_e4m3fn"):
        fp8_gemv(x[:, :32], weight, scale)
    with pytest.raises(ValueError, match=r"needs an fp32 \[16\] scale"):
        fp8_gemv(x, weight, scale[:8])
    with pytest.raises(ValueError, match=r"rows_wanted must be a \[2\] bool mask"):
        fp8_gemv(x, weight, scale, torch.ones(3, dtype=torch.bool, device=device))
    assert fp8_gemv(x[:0], weight, scale).shape == (0, 16)
    x8, x_scale = quantize_activations(x)
    with pytest.raises(ValueError, match="fp8 rows with their x_scale and dtype"):
        fp8_gemv(x8, weight, scale, x_scale=x_scale)
    with pytest.raises(ValueError, match="fp8 rows with their x_scale and dtype"):
        fp8_gemv(x, weight, scale, x_scale=x_scale, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp8 rows with their x_scale and dtype"):
        fp8_gemv(x, weight, scale, dtype=torch.float16)  # 16/32-bit x rounds to its own dtype
    with pytest.raises(ValueError, match=r"x_scale must be fp32 \[2\]"):
        fp8_gemv(x8, weight, scale, x_scale=x_scale[:1], dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["qkv", "o", "gate_up", "down"])
def test_ouro_shapes_under_every_candidate_tiling(device: torch.device, shape: str) -> None:
    """At Ouro-1.4B's sizes: values within bf16 rounding of the exact sums, and a row's bits the
    same alone and among 8 rows, under each tiling `benchmarks.fp8_matmul --gemv` times."""
    from benchmarks.fp8_matmul import GEMV_CANDIDATES, SHAPES

    columns, depth = SHAPES[shape]
    swiglu = shape == "gate_up"
    x, weight, scale = _fp8_operands(8, depth, columns, torch.bfloat16, device)
    gate, up = _exact(x, weight, scale).chunk(2, dim=-1) if swiglu else (None, None)
    for tiling in GEMV_CANDIDATES:
        every = fp8_gemv(x, weight, scale, swiglu=swiglu, tiling=tiling)
        alone = fp8_gemv(x[3:4], weight, scale, swiglu=swiglu, tiling=tiling)
        assert torch.equal(alone, every[3:4])
        x8, x_scale = quantize_activations(x)
        made = fp8_gemv(x8, weight, scale, swiglu=swiglu, tiling=tiling, x_scale=x_scale,
                        dtype=x.dtype)  # fmt: skip
        assert torch.equal(made, every), tiling
        if swiglu:
            expected = torch.nn.functional.silu(gate) * up
            torch.testing.assert_close(every.double(), expected, rtol=2e-2, atol=2e-2)
        else:
            expected = _exact(x, weight, scale)
            torch.testing.assert_close(every.double(), expected, rtol=1e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tiling", TILINGS)
def test_launched_as_a_dependent_the_same_bits(device: torch.device, tiling: GemvTiling) -> None:
    """`pdl` (a programmatic dependent: the first weight tile loads before the kernel waits for
    its inputs, `kernels.pdl`) launched right after the kernels that write its x and its row
    mask: the bits of plain launches, with row masks, SiLU·up and rows that come quantized."""
    from loopserve.kernels.fused_ops import rms_norm

    x, weight, scale = _fp8_operands(3, 300, 2 * 24, torch.bfloat16, device)
    ones = torch.ones(300, device=device)
    normed, _ = rms_norm(x, ones, 1e-6)
    for swiglu in (False, True):
        for masked in (False, True):
            wanted = torch.tensor([True, False, True], device=device) if masked else None
            plain = fp8_gemv(normed, weight, scale, wanted, swiglu=swiglu, tiling=tiling)
            for made in (False, True):
                # x (and the mask) written by the kernels just before the dependent launch
                again, rows = rms_norm(x, ones, 1e-6, quantize=made, pdl=True)
                mask = wanted.clone() if wanted is not None else None
                if rows is None:
                    got = fp8_gemv(again, weight, scale, mask, swiglu=swiglu, tiling=tiling,
                                   pdl=True)  # fmt: skip
                else:
                    got = fp8_gemv(rows[0], weight, scale, mask, swiglu=swiglu, tiling=tiling,
                                   x_scale=rows[1], dtype=again.dtype, pdl=True)  # fmt: skip
                assert torch.equal(got, plain), (swiglu, masked, made)
