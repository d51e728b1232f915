"""The batch-invariant matmuls (kernels/matmul.py): torch's values, and a row's bits the same at
every row count and under every tiling.

Invariance is a property of the compiled kernel (the tensor cores chain 16-wide k slices into one
fp32 accumulator whatever the block shape), so it is checked on the GPU. Triton's CPU interpreter
adds each `tl.dot` block's numpy sum to the accumulator (its bits depend on BLOCK_K) and numpy's
fp32 BLAS rounds a row by its place in the block; there the tests check values and the SwiGLU
epilogue's bits. On the GPU they also hold the kernel to cuBLAS's bits at Ouro's shapes, which is
what lets the engine switch between the two by row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loopserve.kernels.fused_ops import silu_mul
from loopserve.kernels.matmul import Tiling, gate_logit, linear, tiling_for
from tests.kernels.conftest import ON_GPU

# Row counts that reach every tiling bucket (16-bit: up to 16, up to 128, beyond).
ROW_COUNTS = (1, 3, 16, 17, 64, 65, 128, 129, 300)
TILINGS = (
    Tiling(16, 16, 256, 4, 4),
    Tiling(64, 16, 128, 4, 3),
    Tiling(64, 64, 32, 4, 2),
    Tiling(128, 64, 64, 8, 3),
)


def _data(rows: int, depth: int, columns: int, dtype: torch.dtype, device: torch.device):
    generator = torch.Generator().manual_seed(rows * 7 + depth)
    x = torch.randn(rows, depth, generator=generator).to(dtype).to(device)
    weight = (torch.randn(columns, depth, generator=generator) * 0.05).to(dtype).to(device)
    return x, weight


@pytest.mark.parametrize("depth", [300, 512])  # a K tail in every tiling; none
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_values_are_torch_matmuls(device: torch.device, dtype: torch.dtype, depth: int) -> None:
    x, weight = _data(5, depth, 40, dtype, device)  # an N tail too
    expected = x.double() @ weight.double().t()
    tolerance = (
        {"rtol": 1e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    )
    torch.testing.assert_close(linear(x, weight).double(), expected, **tolerance)


def test_exit_gate_casts_and_adds_the_bias(device: torch.device) -> None:
    """fp32 weight and bias, a bf16 hidden state (cast exactly in the kernel), H tails."""
    hidden = _data(6, 1500, 1, torch.bfloat16, device)[0]
    weight = _data(1, 1500, 1, torch.float32, device)[1]
    bias = torch.tensor([0.25], device=device)
    got = gate_logit(hidden, weight, bias)
    assert got.dtype == torch.float32 and got.shape == (6, 1)
    expected = hidden.double() @ weight.double().t() + 0.25
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(gate_logit(hidden[3:4], weight, bias)[0], got[3])  # one program a row
    hazard = gate_logit(hidden, weight, bias, sigmoid=True)  # the exit hazard, in the kernel
    torch.testing.assert_close(hazard.double(), expected.sigmoid(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_have_their_alone_bits_at_every_row_count(
    device: torch.device, dtype: torch.dtype
) -> None:
    x, weight = _data(ROW_COUNTS[-1], 200, 40, dtype, device)
    alone = {row: linear(x[row : row + 1], weight)[0] for row in (0, 15, 16, 63, 64, 128, 299)}
    for rows in ROW_COUNTS:
        out = linear(x[:rows], weight)
        for row, bits in alone.items():
            if row < rows:
                assert torch.equal(out[row], bits), (
                    f"row {row} of {rows} ({tiling_for(rows, 40, dtype)})"
                )


@pytest.mark.gpu
def test_the_tiling_never_changes_the_bits(device: torch.device) -> None:
    x, weight = _data(70, 600, 80, torch.bfloat16, device)
    results = [linear(x, weight, tiling) for tiling in TILINGS]
    for tiling, result in zip(TILINGS[1:], results[1:], strict=True):
        assert torch.equal(result, results[0]), tiling


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_wanted_keeps_their_bits_and_zeroes_the_rest(
    device: torch.device, dtype: torch.dtype
) -> None:
    """Two row blocks (17 rows, 16-row blocks): one with some rows wanted, one with none (its
    program returns before reading weights); the wanted rows have an unmasked call's bits, and an
    fp32 output holds the W-dtype values."""
    x, weight = _data(17, 96, 40, dtype, device)
    wanted = torch.zeros(17, dtype=torch.bool, device=device)
    wanted[[0, 5, 15]] = True
    tiling = Tiling(16, 16, 32, 4, 2)
    every = linear(x, weight, tiling)
    some = linear(x, weight, tiling, rows_wanted=wanted, out_dtype=torch.float32)
    assert some.dtype == torch.float32
    assert torch.equal(some[wanted], every[wanted].float()) and not some[~wanted].any()
    with pytest.raises(ValueError, match="bool mask"):
        linear(x, weight, rows_wanted=wanted[:5])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_is_silu_mul_of_the_two_halves(device: torch.device, dtype: torch.dtype) -> None:
    """SiLU·up as the epilogue: the bits of the plain matmul's two halves through `silu_mul`
    (the same K loop; the halves rounded to W's dtype first), under two tilings, with tails.
    fp32 under the interpreter only to a few units: numpy rounds a column by its place in the
    block, and the up half's columns sit elsewhere in their blocks than in the plain call."""
    x, weight = _data(19, 300, 2 * 24, dtype, device)
    for tiling in (Tiling(16, 16, 256, 4, 4), Tiling(16, 32, 128, 4, 3)):
        gate, up = linear(x, weight, tiling).chunk(2, dim=-1)
        got = linear(x, weight, tiling, swiglu=True)
        expected = silu_mul(gate.contiguous(), up.contiguous())
        assert got.shape == (19, 24)
        if ON_GPU or dtype == torch.bfloat16:
            assert torch.equal(got, expected), tiling
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_refuses_shapes_it_cannot_multiply(device: torch.device) -> None:
    x, weight = _data(2, 64, 16, torch.bfloat16, device)
    with pytest.raises(ValueError, match=r"W must be \[N, K\] of x's dtype"):
        linear(x, weight.t())
    with pytest.raises(ValueError, match=r"W must be \[N, K\] of x's dtype"):
        linear(x, weight.float())
    with pytest.raises(ValueError, match="fp32"):
        gate_logit(x, weight[:1], torch.zeros(1, device=device))
    with pytest.raises(ValueError, match=r"with N even \(swiglu\)"):
        linear(x, weight[:15], swiglu=True)


@pytest.mark.gpu
def test_ouro_projections_have_cublas_bits(device: torch.device) -> None:
    """What lets the engine switch between cuBLAS and this kernel by row count: at Ouro-1.4B's
    qkv, o and gate/up shapes every row count gets cuBLAS's bits (`F.linear`; H200, cuBLAS of
    CUDA 13), and SiLU·up as the epilogue gets cuBLAS's followed by `silu_mul`'s. The down
    projection only where cuBLAS does not split K (512 rows; it does up to 128)."""
    for columns, depth, row_counts in (
        (6144, 2048, (1, 2, 8, 16, 17, 64, 128, 512)),
        (2048, 2048, (1, 8, 16, 64, 512)),
        (11264, 2048, (1, 4, 8, 16, 32, 64, 512)),
        (2048, 5632, (512,)),
    ):
        x, weight = _data(max(row_counts), depth, columns, torch.bfloat16, device)
        for rows in row_counts:
            cublas = F.linear(x[:rows], weight)
            assert torch.equal(linear(x[:rows], weight), cublas), (columns, depth, rows)
            if columns == 11264 and rows <= 16:
                gate, up = cublas.chunk(2, dim=-1)
                fused = linear(x[:rows], weight, swiglu=True)
                assert torch.equal(fused, silu_mul(gate, up)), rows


@pytest.mark.gpu
def test_ouro_down_projection_and_gate_on_the_gpu(device: torch.device) -> None:
    """Ouro-1.4B's down projection and exit gate, rows up to a 2,048-token chunk: every sampled
    row equals its alone bits, and the down projection's values are cuBLAS's to bf16 rounding."""
    x, weight = _data(2048, 5632, 2048, torch.bfloat16, device)
    gate_weight = _data(1, 2048, 1, torch.float32, device)[1]
    bias = torch.tensor([-0.5], device=device)
    hidden = x[:, :2048].contiguous()
    alone = {
        row: (
            linear(x[row : row + 1], weight)[0],
            gate_logit(hidden[row : row + 1], gate_weight, bias)[0],
        )
        for row in (0, 1, 15, 16, 63, 64, 255, 256, 1000, 2047)
    }
    for rows in (1, 2, 16, 17, 48, 64, 96, 128, 129, 256, 257, 512, 1000, 2048):
        down = linear(x[:rows], weight)
        logit = gate_logit(hidden[:rows], gate_weight, bias)
        for row, (down_bits, logit_bits) in alone.items():
            if row < rows:
                assert torch.equal(down[row], down_bits), f"down: row {row} of {rows}"
                assert torch.equal(logit[row], logit_bits), f"gate: row {row} of {rows}"
    torch.testing.assert_close(down, torch.nn.functional.linear(x, weight), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_ouro_lm_head_on_the_gpu(device: torch.device) -> None:
    """Ouro-1.4B's LM head (49,152 columns, the wide tilings): a row's bits alone and inside up to
    128 rows (three tilings) are the same, with a mask (rows asked for among others not) and
    without; values are cuBLAS's to bf16 rounding."""
    x, weight = _data(128, 2048, 49152, torch.bfloat16, device)
    alone = {row: linear(x[row : row + 1], weight)[0] for row in (0, 15, 16, 63, 64, 127)}
    for rows in (1, 2, 16, 17, 32, 64, 65, 128):
        wanted = torch.arange(rows, device=device) % 3 == 0
        out = linear(x[:rows], weight)
        masked = linear(x[:rows], weight, rows_wanted=wanted)
        assert not masked[~wanted].any()
        for row, bits in alone.items():
            if row < rows:
                assert torch.equal(out[row], bits), f"row {row} of {rows}"
                if row % 3 == 0:
                    assert torch.equal(masked[row], bits), f"masked row {row} of {rows}"
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=2e-2, atol=2e-2)
