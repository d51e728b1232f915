"""The fused Triton layer ops against the torch ops they replace (interpreter on CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from loopserve.models.checkpoint_writer import random_state_dict
from loopserve.models.layers import LoopContext
from loopserve.models.ops import RMSNorm, TorchOps, TritonOps
from loopserve.models.ouro import OuroForCausalLM
from loopserve.models.quant import Fp8Linear, Linear, quantize_activations, quantize_model
from loopserve.reference import attend
from tests.conftest import TINY_CONFIG
from tests.kernels.conftest import ON_GPU

DTYPES = [torch.float32, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)
        return
    # bf16: the same rounding points as torch; what differs (the fp32 sum order of the norm, exp,
    # rsqrt, contraction of a product into a sum) moves results by a unit in the last place of an
    # intermediate (measured on an H200: 1-2 units, ~78 % of elements bitwise equal). Triton's
    # CPU interpreter truncates fp32 -> bf16 where the GPU rounds to nearest, which adds a few
    # such units. Units are those of each row's largest magnitude (sums cancel).
    row_max = expected.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    unit = 2.0 ** (torch.floor(torch.log2(row_max)) - 7)
    units = ((actual.float() - expected.float()).abs() / unit).max()
    assert units <= (2 if ON_GPU else 8), f"{units} units in the last place apart"


def norm(size: int, dtype: torch.dtype, device: torch.device) -> RMSNorm:
    module = RMSNorm(size, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(size))
    return module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 100])
def test_norms(dtype: torch.dtype, size: int, device: torch.device) -> None:
    torch.manual_seed(size)
    x = (3 * torch.randn(7, size)).to(device=device, dtype=dtype)
    update = torch.randn(7, size).to(device=device, dtype=dtype)
    first, second = norm(size, dtype, device), norm(size, dtype, device)
    close(TritonOps().rms_norm(x, first), TorchOps().rms_norm(x, first))
    for update_norm in (first, None):  # sandwich-norm (Ouro) and pre-norm (Nanbeige) layers
        fused = TritonOps().add_norm(update, x, update_norm, second)
        reference = TorchOps().add_norm(update, x, update_norm, second)
        close(fused[0], reference[0])
        close(fused[1], reference[1])
    assert not torch.equal(fused[0], TritonOps().add_norm(update, x, first, second)[0])


def test_dependent_launches_only_where_the_gemv_runs() -> None:
    """`TritonOps.dependent`: programmatic dependent launches for fp8 rows through the GEMV
    (up to `GEMV_ROWS` 16-bit rows, not `batch_invariant`), only when set up for them."""
    ops = TritonOps(quantize_inputs=True, dependent_launches=True)
    rows = [torch.zeros(n, 8, dtype=torch.bfloat16) for n in (1, ops.GEMV_ROWS, ops.GEMV_ROWS + 1)]
    assert [ops.dependent(x) for x in rows] == [True, True, False]
    assert not ops.dependent(torch.zeros(1, 8))  # fp32 rows keep the invariant matmul
    invariant = TritonOps(True, quantize_inputs=True, dependent_launches=True)
    assert not invariant.dependent(rows[0])
    assert not TritonOps(quantize_inputs=True).dependent(rows[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_launched_as_dependents_give_the_same_bits(
    dtype: torch.dtype, device: torch.device
) -> None:
    """The norms launched as programmatic dependents (`kernels.pdl`) right after the kernels
    that write their inputs: the bits (and quantized rows) of plain launches."""
    from loopserve.kernels import fused_ops

    x = (3 * torch.randn(2, 2048)).to(device=device, dtype=dtype)
    update = torch.randn(2, 2048).to(device=device, dtype=dtype)
    first, second = norm(2048, dtype, device), norm(2048, dtype, device)
    results = []
    for pdl in (False, True):
        made = x * 2  # written by the kernel just before
        normed, rows = fused_ops.rms_norm(made, first.weight, first.eps, True, pdl=pdl)
        total, added, added_rows = fused_ops.add_norm(
            update * 2, made, first.weight, second.weight, 1e-6, True, pdl
        )
        assert rows is not None and added_rows is not None
        results.append([normed, *rows, total, added, *added_rows])
    for plain, dependent in zip(*results, strict=True):
        assert torch.equal(plain.view(torch.uint8), dependent.view(torch.uint8))


@pytest.mark.parametrize("head_dim", [16, 40])  # 40: half of it is no power of two
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views(
    dtype: torch.dtype, head_dim: int, device: torch.device
) -> None:
    torch.manual_seed(1)
    tokens, q_heads, kv_heads = 5, 4, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim).to(device=device, dtype=dtype)
    angles = torch.randn(tokens, head_dim // 2).repeat(1, 2)
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)

    def views(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = tensor.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        return q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)

    expected = TorchOps().rotary(*views(qkv.clone()), cos, sin)
    fused_input = qkv.clone()
    actual = TritonOps().rotary(*views(fused_input), cos, sin)
    close(actual[0], expected[0])
    close(actual[1], expected[1])
    v_columns = slice((q_heads + kv_heads) * head_dim, None)
    assert torch.equal(fused_input[:, v_columns], qkv[:, v_columns])  # v untouched
    # One launch over q and k (views of one projection) == one launch each (separate tensors).
    from loopserve.kernels import fused_ops

    q, k = views(qkv.clone())
    separate = fused_ops.rotary_qk_(q.clone(), k.clone(), cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(actual, separate, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype, device: torch.device) -> None:
    torch.manual_seed(2)
    gate_up = (2 * torch.randn(6, 2 * 96)).to(device=device, dtype=dtype)
    gate, up = gate_up.split([96, 96], dim=-1)
    close(TritonOps().silu_mul(gate, up), TorchOps().silu_mul(gate, up))


def _projection(
    rows: int, depth: int, dtype: torch.dtype, device: torch.device, fp8: bool
) -> Linear:
    layer = torch.nn.Linear(depth, rows, bias=False, device="meta")
    layer.weight = torch.nn.Parameter((0.1 * torch.randn(rows, depth)).to(device, dtype))
    return Fp8Linear.quantize(layer) if fp8 else layer


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [3, TritonOps.SWIGLU_ROWS + 1])
def test_swiglu(dtype: torch.dtype, device: torch.device, rows: int, fp8: bool) -> None:
    """The fused gate/up projection with SiLU·up: the Triton matmul's epilogue in bf16 up to
    SWIGLU_ROWS rows (fp8 weights: at every row count), cuBLAS and `silu_mul` otherwise; torch's
    values either way."""
    torch.manual_seed(5)
    x = torch.randn(rows, 64).to(device=device, dtype=dtype)
    layer = _projection(2 * 96, 64, dtype, device, fp8)
    got = TritonOps().swiglu(x, layer)
    assert got.shape == (rows, 96) and got.dtype == dtype
    close(got, TorchOps().swiglu(x, layer))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_projections_match_torch(dtype: torch.dtype, device: torch.device) -> None:
    """`linear` and `down_proj` of an fp8 projection: the Triton matmul against `models.quant`'s
    torch math (the products summed in fp32, scaled per row, rounded once)."""
    torch.manual_seed(6)
    x = torch.randn(5, 96).to(device=device, dtype=dtype)
    layer = _projection(40, 96, dtype, device, fp8=True)
    for op in ("linear", "down_proj"):
        got = getattr(TritonOps(), op)(x, layer)
        assert got.dtype == dtype
        close(got, getattr(TorchOps(), op)(x, layer))


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_fp8_rows_take_the_gemv_then_linear_then_scaled_mm(
    device: torch.device, batch_invariant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """16-bit rows of fp8 projections: `kernels.gemv` up to GEMV_ROWS, cuBLAS's fp8 matmul on
    quantized rows past SCALED_MM_ROWS (`scaled_mm`, where it fits: made to fit here, and run by
    torch on the CPU), `kernels.matmul.linear` in between, where cuBLAS does not fit or a row mask
    asks for it; `batch_invariant` and fp32 rows keep `linear` throughout. Every path gives the
    torch values. (The kernels' bits differ on the GPU only, so which one ran is recorded, not
    inferred.)"""
    from loopserve.kernels import gemv, matmul
    from loopserve.models import ops as ops_module

    calls: list[str] = []

    def spy(name: str, kernel: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def call(*args: object, **kwargs: object) -> torch.Tensor:
            calls.append(name)
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(gemv, "fp8_gemv", spy("gemv", gemv.fp8_gemv))
    monkeypatch.setattr(matmul, "linear", spy("linear", matmul.linear))
    monkeypatch.setattr(ops_module, "scaled_mm", spy("scaled_mm", ops_module.scaled_mm))
    torch.manual_seed(7)
    layer = _projection(2 * 48, 96, torch.bfloat16, device, fp8=True)
    ops = TritonOps(batch_invariant=batch_invariant)
    fits = {"now": True}
    monkeypatch.setattr(ops_module, "scaled_mm_fits", lambda x, weight: fits["now"])
    past = ops.SCALED_MM_ROWS + 1
    cases = [
        (1, True),
        (ops.GEMV_ROWS, True),
        (ops.GEMV_ROWS + 1, True),
        (past, False),
        (past, True),
    ]
    for rows, cublas_fits in cases:
        fits["now"] = cublas_fits
        x = torch.randn(rows, 96).to(device=device, dtype=torch.bfloat16)
        calls.clear()
        every = ops.down_proj(x, layer)
        close(every, TorchOps().down_proj(x, layer))
        close(ops.swiglu(x, layer), TorchOps().swiglu(x, layer))
        ops.linear(x, layer)
        wanted = torch.arange(rows, device=device) % 2 == 0
        masked = ops.stage_linear(x, layer, wanted)
        if (
            batch_invariant
            or (rows > ops.GEMV_ROWS and not cublas_fits)
            or ops.GEMV_ROWS < rows <= ops.SCALED_MM_ROWS
        ):
            assert calls == ["linear"] * 4, rows
            assert torch.equal(masked[wanted], every[wanted])
        elif rows <= ops.GEMV_ROWS:
            assert calls == ["gemv"] * 4, rows
            assert torch.equal(masked[wanted], every[wanted])
        else:
            assert calls == ["scaled_mm"] * 3 + ["linear"], rows
            close(masked[wanted], every[wanted])
        assert not masked[~wanted].any()
    calls.clear()
    fits["now"] = True
    ops.linear(torch.randn(2, 96, device=device), layer)
    ops.linear(torch.randn(past, 96, device=device), layer)
    assert calls == ["linear", "linear"]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_rows_the_ops_quantize_on_the_way_out_change_no_bits(
    device: torch.device, batch_invariant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`quantize_inputs`: `add_norm`'s output carries its rows quantized, bit for bit what
    `quantize_rows` makes (`models.quant.quantize_activations`), and so does SiLU·up after
    cuBLAS's fp8 gate/up past SCALED_MM_ROWS; the fp8 projection that reads such a tensor runs no
    `quantize_rows` and gives the bits it gives without the tag."""
    from loopserve.kernels import e4m3
    from loopserve.models import ops as ops_module

    launches: list[int] = []
    quantize_rows = e4m3.quantize_rows

    def counted(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        launches.append(x.shape[0])
        return quantize_rows(x)

    monkeypatch.setattr(e4m3, "quantize_rows", counted)
    monkeypatch.setattr(ops_module, "scaled_mm_fits", lambda x, weight: True)
    torch.manual_seed(8)
    bf16 = torch.bfloat16
    gate_up, down = (
        _projection(2 * 48, 96, bf16, device, True),
        _projection(96, 48, bf16, device, True),
    )
    first, second = norm(96, bf16, device), norm(96, bf16, device)
    plain = TritonOps(batch_invariant)
    tagging = TritonOps(batch_invariant, quantize_inputs=True)
    for rows in (1, plain.GEMV_ROWS + 1, plain.SCALED_MM_ROWS + 1):
        update = torch.randn(rows, 96).to(device=device, dtype=bf16)
        residual = torch.randn(rows, 96).to(device=device, dtype=bf16)
        for normed, tagged in (  # rms_norm's, then add_norm's (what the projections read below)
            (plain.rms_norm(update, first), tagging.rms_norm(update, first)),
            (
                plain.add_norm(update, residual, first, second)[1],
                tagging.add_norm(update, residual, first, second)[1],
            ),
        ):
            assert torch.equal(tagged, normed) and not hasattr(normed, TritonOps.E4M3_ROWS)
            x8, x_scale = getattr(tagged, TritonOps.E4M3_ROWS)
            expected8, expected_scale = quantize_activations(normed)
            assert torch.equal(x8.view(torch.uint8), expected8.view(torch.uint8))
            assert torch.equal(x_scale, expected_scale)
        launches.clear()
        activated = tagging.swiglu(tagged, gate_up)
        out = tagging.down_proj(activated, down)
        fused_rows = not batch_invariant and rows > plain.SCALED_MM_ROWS
        own_pass = not batch_invariant and rows <= plain.GEMV_ROWS  # the GEMV's
        assert launches == ([] if fused_rows or own_pass else [rows]), rows
        assert hasattr(activated, TritonOps.E4M3_ROWS) == fused_rows
        if fused_rows:
            a8, a_scale = getattr(activated, TritonOps.E4M3_ROWS)
            expected8, expected_scale = quantize_activations(activated)
            assert torch.equal(a8.view(torch.uint8), expected8.view(torch.uint8))
            assert torch.equal(a_scale, expected_scale)
        assert torch.equal(activated, plain.swiglu(normed, gate_up))
        assert torch.equal(out, plain.down_proj(activated.clone(), down))  # a clone: no tag


@pytest.mark.parametrize(("batch_invariant", "fp8"), [(False, False), (True, False), (False, True)])
def test_a_fused_loop_matches_the_torch_loop(
    device: torch.device, batch_invariant: bool, fp8: bool
) -> None:
    """Fused projections and fused ops together: one loop of a tiny model and its exit gate,
    fp32 (the gate through kernels/matmul.py); `batch_invariant` puts the down projection there
    too; `fp8` quantizes the projections first (every one then through kernels/matmul.py)."""
    model = OuroForCausalLM(TINY_CONFIG)
    model.load_state_dict(random_state_dict(TINY_CONFIG, seed=4), strict=False)
    model = model.to(device).eval()
    tokens = 9
    hidden = torch.randn(tokens, TINY_CONFIG.hidden_size, device=device)
    cos, sin = model.rope(torch.arange(tokens, device=device))

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, causal=True)

    context = LoopContext(cos, sin, attention)
    with torch.inference_mode():
        if fp8:
            model.fuse_projections()
            assert quantize_model(model) == 4 * TINY_CONFIG.num_hidden_layers
        expected = model.run_loop(hidden, context)
        expected_hazard = model.exit_probability(expected, hidden, 0.5)
        if not fp8:
            model.fuse_projections()
        model.ops = TritonOps(batch_invariant=batch_invariant)
        actual = model.run_loop(hidden, context)
        hazard = model.exit_probability(expected, hidden, 0.5)
        if fp8:  # the rows quantized by add_norm on the way out: the same bits
            model.ops = TritonOps(batch_invariant=batch_invariant, quantize_inputs=True)
            assert torch.equal(model.run_loop(hidden, context), actual)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hazard, expected_hazard, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_computes_the_rows_asked_for(device: torch.device, dtype: torch.dtype) -> None:
    """Both ops give fp32 logits rounded to the model dtype, zeros for rows not asked for, and the
    asked-for rows' values whatever the mask (the Triton one: their bits)."""
    torch.manual_seed(3)
    hidden = torch.randn(6, 64).to(device=device, dtype=dtype)
    weight = (0.1 * torch.randn(300, 64)).to(device=device, dtype=dtype)
    wanted = torch.tensor([True, False, False, True, False, True], device=device)
    for ops in (TorchOps(), TritonOps()):
        every = ops.lm_head(hidden, weight, None)
        some = ops.lm_head(hidden, weight, wanted)
        assert every.dtype == some.dtype == torch.float32
        assert torch.equal(every, every.to(dtype).float())  # rounded to the model dtype
        assert torch.equal(some[wanted], every[wanted]) and not some[~wanted].any()
        assert not ops.lm_head(hidden, weight, torch.zeros_like(wanted)).any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        TritonOps().lm_head(hidden, weight, None),
        TorchOps().lm_head(hidden, weight, None),
        rtol=tolerance,
        atol=tolerance,
    )


def test_huginn_stage_layers_compute_the_rows_asked_for(device: torch.device) -> None:
    """Huginn's prelude and coda through the masked matmul (fp32): the rows a decode step asks
    for equal the torch ops' (whatever the mask), so skipping the others' weights changes
    nothing that is used. Each row attends to itself only, as decode rows of separate requests."""
    from loopserve.models.families import preset_config
    from loopserve.models.loader import build_model

    config = preset_config("huginn-tiny")
    model = build_model(config)
    weights = random_state_dict(config, seed=6)
    model.load_state_dict({k: model.load_transform(k, v) for k, v in weights.items()}, strict=False)
    model.tie_weights()
    model = model.to(device).eval()
    tokens = 7
    ids = torch.arange(3, 3 + tokens, device=device)
    positions = torch.arange(tokens, device=device) + 5
    seeds = torch.full_like(positions, 9)
    cos, sin = model.rope(positions)

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return v  # one key per row: softmax gives its value

    context = LoopContext(cos, sin, attention)
    rows = torch.tensor([True, False, True, True, False, False, True], device=device)
    with torch.inference_mode():
        first = model.start(ids, positions, seeds, context)
        logits = model.compute_logits(model.run_loop(first, context), ctx=context)
        model.ops = TritonOps()
        fused_first = model.start(ids, positions, seeds, context, rows=rows)
        looped = model.run_loop(fused_first, context)
        fused_logits = model.compute_logits(looped, rows=rows, ctx=context)
    torch.testing.assert_close(fused_first[rows], first[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_logits[rows], logits[rows], rtol=1e-4, atol=1e-4)
    assert not fused_logits[~rows].any()
