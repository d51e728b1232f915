"""FP8's rules (`models.quant`): one scale per weight row and one per activation row, e4m3
rounding to nearest even with saturation, the projection's sums and scales, which projections are
quantized, fused projections keeping their parts' bits, and the setting checked at the
boundary."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loopserve.config import EngineConfig
from loopserve.kv.storage import FP8, FP8_MAX
from loopserve.models.ouro import OuroForCausalLM
from loopserve.models.quant import (
    Fp8Linear,
    fp8_linear,
    fused_linear,
    quantization_of,
    quantize_activations,
    quantize_model,
    quantize_weight,
    scaled_mm,
)
from tests.conftest import TINY_CONFIG


def test_each_row_is_scaled_to_the_fp8_range() -> None:
    weight = torch.randn(6, 50) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 1e3, 0.0])[:, None]
    weight8, scale = quantize_weight(weight)
    assert weight8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (6,)
    assert scale[5] == 1.0 and not weight8[5].float().any()  # a row of zeros
    peaks = weight8.float().abs().amax(dim=1)
    assert torch.equal(peaks[:5], torch.full((5,), FP8_MAX))  # each row's largest is +-448
    # e4m3 keeps 3 mantissa bits: every value within half a unit (2^-4 relative) of the weight
    error = (weight8.float() * scale[:, None] - weight).abs()
    assert (error <= weight.abs() * 2**-4 + scale[:, None] * 2**-10).all()


def test_rounding_is_to_nearest_even() -> None:
    # scale 1 (largest 448): 9.5 lies halfway between 9 and 10 (e4m3 steps of 1 in [8, 16));
    # 10.5 between 10 and 11; 17 between 16 and 18 -> the even mantissas 10, 10 and 16.
    weight = torch.tensor([[448.0, 9.5, 10.5, 17.0, -9.5]])
    weight8, scale = quantize_weight(weight)
    assert scale.item() == 1.0
    assert weight8.float().tolist() == [[448.0, 10.0, 10.0, 16.0, -10.0]]


def test_each_activation_row_gets_its_own_scale() -> None:
    """t = max |x[m]| * (1 / 448) and x8 = x * (448 / max |x[m]|), rounded to nearest even: a row's
    largest value lands on +-448, a row of zeros keeps scale 1, and one row's values never move
    another's."""
    x = torch.randn(5, 40) * torch.tensor([1e-4, 1.0, 30.0, 0.0, 1e4])[:, None]
    x[1, 7] = -5.0  # row 1's largest is negative
    x8, scale = quantize_activations(x.to(torch.bfloat16))
    assert x8.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (5,)
    amax = x.to(torch.bfloat16).float().abs().amax(dim=1)
    assert torch.equal(scale[[0, 1, 2, 4]], amax[[0, 1, 2, 4]] * (1 / FP8_MAX))
    assert scale[3] == 1.0 and not x8[3].float().any()
    assert x8[1, 7].item() == -FP8_MAX
    assert torch.equal(x8.float().abs().amax(dim=1)[[0, 1, 2, 4]], torch.full((4,), FP8_MAX))
    alone = quantize_activations(x[2:3].to(torch.bfloat16))
    assert torch.equal(alone[0].float(), x8[2:3].float()) and torch.equal(alone[1], scale[2:3])
    # 448 / 896 = 0.5 exactly: 19 * 0.5 = 9.5 lies halfway between 9 and 10 -> the even 10
    halves = quantize_activations(torch.tensor([[896.0, 19.0, -21.0]]))[0]
    assert halves.float().tolist() == [[448.0, 10.0, -10.0]]


def test_fp8_linear_quantizes_the_rows_sums_exactly_and_rounds_once() -> None:
    weight8, scale = quantize_weight(torch.randn(8, 32))
    x = torch.randn(3, 32).to(torch.bfloat16)
    got = fp8_linear(x, weight8, scale)
    assert got.dtype == torch.bfloat16
    x8, x_scale = quantize_activations(x)
    exact = (x8.double() @ weight8.double().t()) * x_scale.double()[:, None] * scale.double()
    assert torch.equal(got, exact.float().to(torch.bfloat16))
    unquantized = (x.double() @ weight8.double().t()) * scale.double()
    assert not torch.equal(got, unquantized.float().to(torch.bfloat16))  # x was quantized


def test_scaled_mm_computes_fp8_linear_s_values() -> None:
    """cuBLAS's fp8 matmul (torch's CPU one where there is no GPU; torch 2.11's CPU took only
    one scale per tensor) on the quantized rows: `fp8_linear`'s values to bf16 rounding (its sums
    and scaling run in their own order)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight8, scale = quantize_weight(torch.randn(48, 64, device=device))
    x = torch.randn(32, 64, device=device).to(torch.bfloat16)
    got = scaled_mm(*quantize_activations(x), weight8, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (32, 48)
    torch.testing.assert_close(got, fp8_linear(x, weight8, scale), rtol=1e-2, atol=1e-2)


def test_fused_fp8_projections_keep_their_parts_bits() -> None:
    parts = [Fp8Linear.quantize(nn.Linear(32, rows, bias=False)) for rows in (8, 4, 4)]
    fused = fused_linear(parts)
    assert isinstance(fused, Fp8Linear) and fused.out_features == 16
    x = torch.randn(5, 32)
    assert torch.equal(fused(x), torch.cat([part(x) for part in parts], dim=-1))
    with pytest.raises(ValueError, match="cannot fuse fp8 projections with unquantized"):
        fused_linear([parts[0], nn.Linear(32, 4, bias=False)])


def test_the_layers_are_quantized_and_the_rest_is_not() -> None:
    model = OuroForCausalLM(TINY_CONFIG)
    model.fuse_projections()
    assert quantization_of(model) == "none"
    assert quantize_model(model) == 4 * TINY_CONFIG.num_hidden_layers
    assert quantization_of(model) == "fp8"
    dtypes = {name: param.dtype for name, param in model.named_parameters()}
    for name, dtype in dtypes.items():
        projection = ".layers." in name and name.endswith("_proj.weight")
        assert (dtype == FP8) == projection, name
    assert dtypes["model.early_exit_gate.weight"] == torch.float32  # the exit gate, unquantized
    assert isinstance(model.lm_head, nn.Linear)


def test_fp8_linear_checks_what_it_is_given() -> None:
    with pytest.raises(ValueError, match=r"Fp8Linear needs a torch\.float8_e4m3fn weight"):
        Fp8Linear(torch.zeros(4, 8), torch.ones(4))
    with pytest.raises(ValueError, match="only bias-free projections"):
        Fp8Linear.quantize(nn.Linear(8, 4))


def test_the_setting_is_checked_at_the_boundary() -> None:
    with pytest.raises(ValueError, match=r"quantization.*must be one of \('none', 'fp8'\)"):
        EngineConfig.from_options(quantization="int4")
