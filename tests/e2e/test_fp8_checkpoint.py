"""Checkpoints that carry fp8 weights (vLLM's fp8 format: e4m3 projections, a `weight_scale` per
tensor or per output channel, `quantization_config` {"quant_method": "fp8", "activation_scheme":
"dynamic"}) load without requantizing: per channel they equal quantizing the unquantized
checkpoint at load, per tensor the engine equals the serial reference on them; vLLM's per-layer
fp8 KV cache scales (`self_attn.k_scale`, `v_scale`) are the cache's; and what does not match
the format is refused before the weights load, saying what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loopserve import LLM, SamplingParams
from loopserve.models.checkpoint_writer import fp8_state_dict, random_state_dict, write_checkpoint
from loopserve.models.families import preset_config
from loopserve.models.loader import CheckpointError
from loopserve.models.model_config import ConfigError
from loopserve.reference import SerialReference
from tests.conftest import TINY_CONFIG, VARIED_GATE
from tests.e2e.test_fp8_kv_cache import engine_kv_scales

CONFIGS = {"ouro": TINY_CONFIG, "nanbeige": preset_config("nanbeige-tiny", {"eos_token_id": None})}
PROMPTS = [[7, 3, 9, 120, 44, 2], [200], list(range(30, 60))]


def _write(directory: Path, family: str, per_tensor: bool = False) -> Path:
    config = CONFIGS[family]
    tensors = random_state_dict(config, seed=4, init=VARIED_GATE if family == "ouro" else None)
    return write_checkpoint(directory, config, fp8_state_dict(config, tensors, per_tensor))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_per_channel_checkpoints_equal_quantizing_at_load(tmp_path: Path, family: str) -> None:
    config = CONFIGS[family]
    tensors = random_state_dict(config, seed=4)
    plain = write_checkpoint(tmp_path / "plain", config, tensors)
    stored = write_checkpoint(tmp_path / "fp8", config, fp8_state_dict(config, tensors))
    assert json.loads((stored / "config.json").read_text())["quantization_config"] == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
    }
    loaded = LLM(str(stored), dtype="float32", num_kv_pages=64)
    quantized = LLM(str(plain), dtype="float32", num_kv_pages=64, quantization="fp8")
    assert loaded.engine.info.quantization == quantized.engine.info.quantization == "fp8"
    ours = dict(loaded.engine.runner.model.named_parameters())  # type: ignore[attr-defined]
    theirs = dict(quantized.engine.runner.model.named_parameters())  # type: ignore[attr-defined]
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert param.dtype == theirs[name].dtype and torch.equal(param, theirs[name]), name


@pytest.mark.parametrize("layout", ["full", "shared"])
def test_the_engine_equals_the_reference_on_a_per_tensor_checkpoint(
    tmp_path: Path, layout: str
) -> None:
    llm = LLM(str(_write(tmp_path, "ouro", per_tensor=True)), dtype="float32", kv_layout=layout)
    params = [SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.6) for _ in PROMPTS]
    outputs = llm.generate(PROMPTS, params)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    scales = {p.numel() for n, p in model.named_parameters() if n.endswith("weight_scale")}
    assert scales and 1 not in scales  # one scale per tensor, spread over its rows at load
    reference = SerialReference(model, kv_layout=layout, exit_mode="ouro")
    for prompt, request, output in zip(PROMPTS, params, outputs, strict=True):
        expected = reference.generate(prompt, llm.engine.resolve(request))
        assert output.outputs[0].token_ids == expected.token_ids
        assert output.outputs[0].exit_depths == expected.exit_depths


def _edit_tensors(directory: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


NAME = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(NAME + "_scale"), "missing 1 tensor"),
        (
            lambda t: t.__setitem__(NAME, t[NAME].float()),
            r"is F32, but the config's fp8 quantization_config stores the layers' projections",
        ),
        (
            lambda t: t.__setitem__(NAME + "_scale", torch.ones(3, 5)),
            r"an fp8 weight's scale must be a float of shape \[\], \[1\], \[64\] or \[64, 1\]",
        ),
    ],
)
def test_a_checkpoint_that_breaks_the_format_is_refused(tmp_path: Path, edit, message) -> None:  # type: ignore[no-untyped-def]
    directory = _write(tmp_path, "ouro")
    _edit_tensors(directory, edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(str(directory), dtype="float32", num_kv_pages=64)


@pytest.mark.parametrize(
    "extra",
    [{"weight_block_size": [128, 128]}, {"activation_scheme": "static"}, {"ignored_layers": ["x"]}],
)
def test_fp8_formats_other_than_loopserves_are_refused(tmp_path: Path, extra: dict) -> None:  # type: ignore[type-arg]
    directory = _write(tmp_path, "ouro")
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] |= extra
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="fp8 checkpoints load with quant_method 'fp8'"):
        LLM(str(directory), dtype="float32", num_kv_pages=64)


# vLLM's per-layer fp8 KV cache scales, small enough that the larger K/V saturate.
KV_SCALES = {0: (0.005, 0.02), 1: (0.011, 0.003)}


def _kv_scale_tensors(scale: dict[int, tuple[float, float]]) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{layer}.self_attn.{name}": torch.tensor(value)
        for layer, pair in scale.items()
        for name, value in zip(("k_scale", "v_scale"), pair, strict=True)
    }


def _write_with_kv_scales(directory: Path, fp8_weights: bool = True) -> Path:
    config = TINY_CONFIG
    tensors = random_state_dict(config, seed=4, init=VARIED_GATE)
    if fp8_weights:
        tensors = fp8_state_dict(config, tensors)
    return write_checkpoint(directory, config, tensors | _kv_scale_tensors(KV_SCALES))


@pytest.mark.parametrize("layout", ["full", "shared"])
def test_a_checkpoint_s_kv_scales_are_the_cache_s(tmp_path: Path, layout: str) -> None:
    """`k_scale` / `v_scale` beside each layer's attention: the fp8 cache stores K/V with them
    (reported as "checkpoint"), and the engine equals the reference that keeps K/V with them;
    they change tokens against scale 1, so the equality tests them."""
    llm = LLM(
        str(_write_with_kv_scales(tmp_path)), dtype="float32", kv_layout=layout,
        kv_cache_dtype="fp8", num_kv_pages=64,
    )  # fmt: skip
    assert llm.engine.info.kv_cache_scales == "checkpoint"
    scales = engine_kv_scales(llm.engine)
    assert scales is not None
    assert torch.equal(scales.scale, torch.tensor([KV_SCALES[0], KV_SCALES[1]]))
    params = [SamplingParams(max_tokens=8, temperature=0.0, exit_threshold=0.6) for _ in PROMPTS]
    outputs = llm.generate(PROMPTS, params)
    model = llm.engine.runner.model  # type: ignore[attr-defined]
    scaled, unit = (
        SerialReference(
            model, kv_layout=layout, exit_mode="ouro", kv_cache_dtype="fp8", kv_scales=kv_scales
        )
        for kv_scales in (scales, None)
    )
    runs = []
    for prompt, request, output in zip(PROMPTS, params, outputs, strict=True):
        expected = scaled.generate(prompt, llm.engine.resolve(request))
        assert output.outputs[0].token_ids == expected.token_ids
        assert output.outputs[0].exit_depths == expected.exit_depths
        runs.append(unit.generate(prompt, llm.engine.resolve(request)).token_ids)
    assert runs != [output.outputs[0].token_ids for output in outputs]


def test_kv_scales_load_from_unquantized_weights_and_only_for_an_fp8_cache(
    tmp_path: Path,
) -> None:
    directory = _write_with_kv_scales(tmp_path, fp8_weights=False)
    fp8 = LLM(str(directory), dtype="float32", kv_cache_dtype="fp8", num_kv_pages=16)
    assert fp8.engine.info.quantization == "none"
    assert fp8.engine.info.kv_cache_scales == "checkpoint"
    assert LLM(str(directory), dtype="float32", num_kv_pages=16).engine.info.kv_cache_scales is None
    calculated = LLM(
        str(directory), dtype="float32", kv_cache_dtype="fp8", calculate_kv_scales=True,
        num_kv_pages=16,
    )  # fmt: skip
    assert calculated.engine.info.kv_cache_scales == "calculated"  # the flag overrides them


KV_SCALE = "model.layers.1.self_attn.v_scale"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop(KV_SCALE), "fp8 KV cache scales .* for some layers only: 1 missing"),
        (lambda t: t.__setitem__(KV_SCALE, torch.ones(2)), r"must be one float, of shape \[\]"),
        (lambda t: t.__setitem__(KV_SCALE, torch.tensor(0.0)), "must be a positive finite"),
        (lambda t: t.__setitem__(KV_SCALE, torch.tensor(-1.0)), "must be a positive finite"),
        (  # vLLM's older single scale, not understood
            lambda t: t.__setitem__("model.layers.0.self_attn.kv_scale", torch.tensor(1.0)),
            "unexpected tensor.*kv_scale",
        ),
    ],
)
def test_kv_scales_that_break_the_format_are_refused(tmp_path: Path, edit, message) -> None:  # type: ignore[no-untyped-def]
    directory = _write_with_kv_scales(tmp_path)
    _edit_tensors(directory, edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(str(directory), dtype="float32", kv_cache_dtype="fp8", num_kv_pages=16)
