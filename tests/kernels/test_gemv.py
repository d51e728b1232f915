"""The decode matmul (kernels/gemv.py) against torch: masking, the split of K, the SiLU·up
prologue, bitwise batch invariance, and how `TritonOps` routes the projections (interpreter on a
CPU, small shapes); Ouro-1.4B's shapes compiled on a GPU (`pytest -m gpu`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loopserve.kernels import gemv
from loopserve.kernels.gemv import GemvTiling
from loopserve.models import ops as ops_module
from loopserve.models.ops import TorchOps, TritonOps

# Small tiles so that tiny shapes still have several column blocks, K tiles and slices.
SMALL = GemvTiling(block_n=16, block_k=32, target_programs=12)
OURO_1_4B = {  # (N, K) of the fused projections; down's K is the intermediate size
    "qkv": (6144, 2048),
    "o": (2048, 2048),
    "gate_up": (11264, 2048),
    "down": (2048, 5632),
}


def assert_matmul_close(actual: torch.Tensor, expected: torch.Tensor, k: int) -> None:
    """fp32: a different summation order only. bf16/fp16: the product of rounded inputs is the
    reference (fp32 math); the result is rounded once (the interpreter truncates), and sums
    cancel, so the error is bounded in units of each row's largest magnitude."""
    assert actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * k**0.5)
        return
    mantissa = 7 if actual.dtype == torch.bfloat16 else 10
    row_max = expected.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    unit = 2.0 ** (torch.floor(torch.log2(row_max)) - mantissa)
    units = ((actual.float() - expected).abs() / unit).max()
    assert units <= 2, f"{units} units in the last place apart"


def _inputs(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
    weight = (torch.randn(n, k, generator=generator) / k**0.5).to(device=device, dtype=dtype)
    return x, weight


def test_tiling_split_depends_on_the_shape_only() -> None:
    tiling = GemvTiling(block_n=64, block_k=128, target_programs=264)
    assert tiling.split(2048, 2048) == (8, 256)  # 32 column blocks x 8 slices
    assert tiling.split(2048, 5632) == (9, 640)  # 44 K tiles: 5 per slice, the last has 4
    assert tiling.split(11264, 2048) == (2, 1024)
    assert tiling.split(64, 100) == (1, 128)  # never more slices than K tiles
    with pytest.raises(ValueError):
        GemvTiling(block_n=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_linear_against_torch(m: int, dtype: torch.dtype, device: torch.device) -> None:
    n, k = 75, 203  # odd: masked columns and a partial last K tile
    x, weight = _inputs(m, n, k, dtype, device, seed=m)
    assert SMALL.split(n, k)[0] > 1
    expected = F.linear(x.double(), weight.double()).float()
    assert_matmul_close(gemv.linear(x, weight, SMALL), expected, k)


def test_more_than_sixteen_rows_and_one_slice(device: torch.device) -> None:
    x, weight = _inputs(19, 40, 64, torch.float16, device, seed=5)
    tiling = GemvTiling(block_n=16, block_k=64, target_programs=1)
    assert tiling.split(40, 64)[0] == 1  # stores directly, no workspace
    expected = F.linear(x.double(), weight.double()).float()
    assert_matmul_close(gemv.linear(x, weight, tiling), expected, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_linear_rounds_like_silu_mul_then_linear(
    dtype: torch.dtype, device: torch.device
) -> None:
    m, inner, n = 3, 150, 37
    gate_up, weight = _inputs(m, n, 2 * inner, dtype, device, seed=11)
    gate_up = 2 * gate_up
    weight = weight[:, :inner].contiguous()
    gate, up = gate_up.split([inner, inner], dim=-1)
    activated = F.silu(gate) * up  # rounded to the dtype, as the kernel rounds it
    expected = F.linear(activated.double(), weight.double()).float()
    assert_matmul_close(gemv.silu_linear(gate, up, weight, SMALL), expected, inner)


@pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu_linear"])
@pytest.mark.parametrize("batch", [8, 16])
def test_a_row_alone_equals_the_row_inside_a_batch(
    batch: int, silu: bool, device: torch.device
) -> None:
    n, k = 50, 160
    x, weight = _inputs(batch, n, 2 * k if silu else k, torch.bfloat16, device, seed=batch)
    weight = weight[:, :k].contiguous()

    def run(rows: torch.Tensor) -> torch.Tensor:
        if silu:
            return gemv.silu_linear(*rows.split([k, k], dim=-1), weight, SMALL)
        return gemv.linear(rows, weight, SMALL)

    together = run(x)
    for index in (0, batch // 2 + 1, batch - 1):
        assert torch.equal(run(x[index : index + 1]), together[index : index + 1])
        others = torch.randn_like(x, dtype=torch.float32).to(x.dtype)
        others[index] = x[index]
        assert torch.equal(run(others)[index], together[index])


def _linear(n: int, k: int, dtype: torch.dtype, device: torch.device) -> nn.Linear:
    module = nn.Linear(k, n, bias=False).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(_inputs(1, n, k, dtype, device, seed=n)[1])
    return module


def _recording(kernel: Callable[..., torch.Tensor], name: str, calls: list[str]) -> Callable:
    def record(*args: torch.Tensor) -> torch.Tensor:
        calls.append(name)
        return kernel(*args)

    return record


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_ops_route_few_rows_to_the_kernel(
    dtype: torch.dtype, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 at M <= the table's threshold: the kernel; more rows or fp32: F.linear (the SiLU·up
    kernel first for the down projection)."""
    monkeypatch.setitem(ops_module.GEMV_MAX_ROWS, "o", 4)
    launched: list[str] = []
    for name in ("linear", "silu_linear"):
        monkeypatch.setattr(gemv, name, _recording(getattr(gemv, name), name, launched))
    module = _linear(24, 40, dtype, device)
    triton_ops, torch_ops = TritonOps(), TorchOps()
    for rows in (1, 4, 5):
        x = _inputs(rows, 24, 40, dtype, device, seed=rows)[0]
        actual = triton_ops.linear(x, module, "o")
        expected = F.linear(x.double(), module.weight.double()).float()
        assert_matmul_close(actual, expected, 40)
        if rows > 4 or dtype == torch.float32:
            assert torch.equal(actual, torch_ops.linear(x, module, "o"))
    gate_up = _inputs(3, 24, 80, dtype, device, seed=3)[0]
    gate, up = gate_up.split([40, 40], dim=-1)
    activated = F.silu(gate) * up
    actual = triton_ops.down(gate, up, module)
    assert_matmul_close(actual, F.linear(activated.double(), module.weight.double()).float(), 40)
    kernel_calls = ["linear", "linear", "silu_linear"] if dtype == torch.bfloat16 else []
    assert launched == kernel_calls


@pytest.mark.gpu
@pytest.mark.parametrize("projection", list(OURO_1_4B))
def test_ouro_shapes_compiled(projection: str) -> None:
    """Ouro-1.4B's projections, bf16, the default tiling: against fp64, bitwise batch invariance
    (M = 1 .. 16 and 32), and a CUDA-graph replay equal to the eager call."""
    n, k = OURO_1_4B[projection]
    device = torch.device("cuda")
    silu = projection == "down"
    x, weight = _inputs(32, n, 2 * k if silu else k, torch.bfloat16, device, seed=7)
    weight = weight[:, :k].contiguous()

    def run(rows: torch.Tensor) -> torch.Tensor:
        if silu:
            return gemv.silu_linear(*rows.split([k, k], dim=-1), weight)
        return gemv.linear(rows, weight)

    full = run(x)
    inputs = (F.silu(x[:, :k]) * x[:, k:]) if silu else x
    expected = F.linear(inputs.double(), weight.double()).float()
    assert_matmul_close(full, expected, k)
    for m in (1, 2, 3, 4, 8, 16):
        assert torch.equal(run(x[:m]), full[:m]), m
        assert torch.equal(run(x[m - 1 : m]), full[m - 1 : m]), m
    static = x[:4].clone()
    run(static)  # compiled and the counters allocated before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(static)
    static.copy_(x[4:8])
    for _ in range(3):  # the arrival counters are back at zero after every replay
        graph.replay()
        assert torch.equal(captured, full[4:8])
