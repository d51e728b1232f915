"""The fp8 KV cache's per-layer K and V scales: the one storage rule with scales (saturation
included), the scales' own checks, and calibration (`calculate_kv_scales`): which K/V it
measures, the rule from them to scales, and its refusal without an fp8 cache."""

from __future__ import annotations

import pytest
import torch

from loopserve.config import EngineConfig
from loopserve.kv.storage import (
    FP8,
    FP8_MAX,
    K,
    KVFormat,
    KVScales,
    KVStorage,
    V,
    from_cache,
    to_cache_dtype,
)
from loopserve.models.checkpoint_writer import RandomInit, random_state_dict
from loopserve.models.families import preset_config
from loopserve.models.kv_scales import (
    CALIBRATION_PROMPTS,
    HEADROOM,
    calculate_kv_scales,
    calibration_prompts,
    kv_amax,
    scales_from_amax,
)
from loopserve.models.loader import build_model
from loopserve.models.looped import LoopedForCausalLM
from loopserve.reference import SerialReference, _DenseKV


def test_scaled_values_are_stored_over_the_scale_and_read_times_it() -> None:
    scale = torch.tensor(0.05)
    inverse = 1.0 / scale
    x = torch.tensor([0.0, -0.0, 0.3, -2.5, 10.0, 22.0, 50.0, -1000.0])
    stored = to_cache_dtype(x, FP8, inverse)
    assert stored.dtype == FP8
    assert stored.float().tolist()[-2:] == [FP8_MAX, -FP8_MAX]  # 50 / 0.05 = 1000: saturated
    assert torch.equal(stored.float(), (x * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8).float())
    read = from_cache(stored, torch.float32, scale)
    assert read[-1] == -FP8_MAX * scale  # the largest value a scale of 0.05 keeps is 22.4
    torch.testing.assert_close(read[:6], x[:6], rtol=2**-4, atol=0)  # e4m3: 3 mantissa bits
    assert torch.equal(read[:2].signbit(), x[:2].signbit())
    bf16 = from_cache(stored, torch.bfloat16, scale)  # rounded once, from the fp32 product
    assert torch.equal(bf16, (stored.float() * scale).to(torch.bfloat16))


def test_a_small_scale_keeps_small_values_that_scale_one_rounds_away() -> None:
    """e4m3 is subnormal below 2**-6: unscaled, 0.001 is stored as 0 or 2**-9."""
    x = torch.tensor([0.001, -0.0031, 0.0007])
    scale = x.abs().max() * HEADROOM / FP8_MAX
    unit = from_cache(to_cache_dtype(x, FP8), torch.float32)
    scaled = from_cache(to_cache_dtype(x, FP8, 1.0 / scale), torch.float32, scale)
    assert ((scaled - x).abs() < (unit - x).abs()).all()
    torch.testing.assert_close(scaled, x, rtol=2**-4, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_scale_one_keeps_every_bit(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=generator) * s for s in (0.01, 3.0, 300.0)])
    x = x.to(dtype)
    one = torch.tensor(1.0)
    stored = to_cache_dtype(x, FP8)
    assert torch.equal(to_cache_dtype(x, FP8, one).view(torch.uint8), stored.view(torch.uint8))
    assert torch.equal(from_cache(stored, dtype, one), stored.to(dtype))


@pytest.mark.parametrize(
    ("scale", "words"),
    [
        (torch.tensor([[1.0, 0.0]]), "finite and positive"),
        (torch.tensor([[1.0, -2.0]]), "finite and positive"),
        (torch.tensor([[float("nan"), 1.0]]), "finite and positive"),
        (torch.tensor([[float("inf"), 1.0]]), "finite and positive"),
        (torch.ones(3), r"\[layers, 2\]"),
    ],
)
def test_scales_are_positive_finite_pairs(scale: torch.Tensor, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        KVScales(scale, "checkpoint")


def test_reciprocals_are_fp32_divisions_made_once_on_the_host() -> None:
    scale = torch.tensor([[0.013, 3.0], [0.07, 1.0]], dtype=torch.float64)  # taken as fp32
    scales = KVScales(scale, "calculated")
    assert scales.scale.dtype == scales.inverse.dtype == torch.float32
    assert torch.equal(scales.inverse, 1.0 / scale.float())
    unit = KVScales.unit(3)
    assert unit.source == "1.0" and torch.equal(unit.scale, torch.ones(3, 2))
    with pytest.raises(ValueError, match="source"):
        KVScales(scale, "guessed")


def test_each_layer_and_kind_reads_its_own_scale() -> None:
    """A value 1.5 times past a scale's range comes back as exactly 448 times that scale."""
    scales = KVScales(torch.tensor([[0.5, 0.25], [0.125, 2.0]]), "checkpoint")
    kept = KVFormat(FP8, scales)
    for layer in range(2):
        for kind in (K, V):
            scale = float(scales.scale[layer, kind])
            x = torch.full((3,), 1.5 * FP8_MAX * scale)
            assert kept.stored(x, layer, kind).tolist() == [FP8_MAX * scale] * 3
    with pytest.raises(ValueError, match="fp8 cache only"):
        KVFormat(None, scales)


def test_the_storage_takes_scales_for_an_fp8_cache_only() -> None:
    shape = {"num_layers": 2, "num_pages": 2, "block_size": 4, "num_kv_heads": 1, "head_dim": 8}
    kv = KVStorage(**shape, dtype=FP8, device="cpu")  # type: ignore[arg-type]
    assert torch.equal(kv.scales, torch.ones(2, 2))  # 1 until scales are set
    scales = KVScales(torch.tensor([[0.5, 0.25], [0.125, 2.0]]), "calculated")
    kv.set_scales(scales)
    assert torch.equal(kv.scales, scales.scale) and torch.equal(kv.inverse_scales, scales.inverse)
    with pytest.raises(ValueError, match="3 layers of KV scales for a cache of 2"):
        kv.set_scales(KVScales.unit(3))
    bf16 = KVStorage(**shape, dtype=torch.bfloat16, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp8 cache only"):
        bf16.set_scales(scales)


def test_calibration_prompts_are_fixed_token_ids() -> None:
    prompts = calibration_prompts(4096, 2048)
    assert prompts.shape == (CALIBRATION_PROMPTS, 128)
    assert prompts.view(-1)[:4].tolist() == [i * 2654435761 % 4096 for i in range(4)]
    assert torch.equal(prompts, calibration_prompts(4096, 2048))
    assert len(set(prompts.view(-1).tolist())) > 400  # spread over the vocabulary
    assert calibration_prompts(100, 40).shape == (CALIBRATION_PROMPTS, 40)  # the model's length
    assert int(calibration_prompts(100, 40).max()) < 100


def test_scales_are_the_largest_values_times_the_headroom_over_448() -> None:
    amax = torch.tensor([[10.0, 0.0], [448.0, 1.0]])
    scales = scales_from_amax(amax)
    expected = torch.tensor([[10.0 * HEADROOM / 448, 1.0], [HEADROOM, HEADROOM / 448]])
    assert scales.source == "calculated"
    torch.testing.assert_close(scales.scale, expected, rtol=0, atol=0)  # an all-zero V keeps 1
    with pytest.raises(ValueError, match="not finite"):
        scales_from_amax(torch.tensor([[float("nan"), 1.0]]))


def _model(preset: str, fields: dict[str, object] | None = None) -> LoopedForCausalLM:
    config = preset_config(preset, fields or {})
    model = build_model(config)
    init = RandomInit(gate_scale=2.0, gate_bias=-1.0) if preset == "tiny" else None
    model.load_state_dict(random_state_dict(config, seed=1, init=init), strict=False)
    model.fuse_projections()
    return model.eval()


HUGINN = {
    "n_layers": 3, "n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 1,
    "n_layers_in_coda": 1, "mean_recurrence": 3,
}  # fmt: skip


@pytest.mark.parametrize(("preset", "fields"), [("tiny", None), ("huginn-tiny", HUGINN)])
def test_calibration_measures_every_kv_layer_over_every_loop(
    preset: str, fields: dict[str, object] | None
) -> None:
    """The largest |K| and |V| per KV layer equal those the serial reference keeps after the
    same prompts' prefill: every plane (loop) of the block's layers, and (Huginn) the prelude's
    and coda's layers, numbered after the block's."""
    model = _model(preset, fields)
    prompts = calibration_prompts(model.config.vocab_size, 24)
    expected = torch.zeros(model.num_kv_layers, 2)
    loops, layers = model.config.num_loops, model.config.num_hidden_layers
    reference = SerialReference(model)
    deeper = False
    for prompt in prompts.tolist():
        kv = _DenseKV(loops, layers, reference.kv_format)
        stages = _DenseKV(1, model.num_kv_layers, reference.kv_format)
        reference._prefill(prompt, loops, kv, stages)
        kept = [(layer, kv.get(plane, layer)) for plane in range(loops) for layer in range(layers)]
        kept += [(layer, stages.get(0, layer)) for layer in range(layers, model.num_kv_layers)]
        for layer, (keys, values) in kept:
            seen = torch.stack([keys.abs().max(), values.abs().max()])
            expected[layer] = torch.maximum(expected[layer], seen)
        first = torch.stack([kv.get(0, 0)[0].abs().max(), kv.get(0, 0)[1].abs().max()])
        deeper |= bool((first < expected[0]).any())
    assert deeper, "a later loop should hold layer 0's largest value (else loops are untested)"
    torch.testing.assert_close(kv_amax(model, prompts), expected, rtol=1e-5, atol=0)


def test_calculated_scales_are_finite_positive_and_per_layer() -> None:
    model = _model("tiny")
    scales = calculate_kv_scales(model)
    assert scales.source == "calculated"
    assert scales.scale.shape == (model.num_kv_layers, 2)
    assert bool(torch.isfinite(scales.scale).all() and (scales.scale > 0).all())
    assert len(set(scales.scale.view(-1).tolist())) == scales.scale.numel()  # none left at 1
    prompts = calibration_prompts(model.config.vocab_size, model.config.max_position_embeddings)
    torch.testing.assert_close(scales.scale, kv_amax(model, prompts) * HEADROOM / FP8_MAX)


def test_calculate_kv_scales_needs_an_fp8_cache() -> None:
    words = r"calculate_kv_scales \(--calculate-kv-scales\) needs kv_cache_dtype \(--kv-cache-dtype"
    with pytest.raises(ValueError, match=words + r"\) fp8"):
        EngineConfig(calculate_kv_scales=True)
    assert EngineConfig(kv_cache_dtype="fp8", calculate_kv_scales=True).calculate_kv_scales
